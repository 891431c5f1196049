//! The outbox example as a user runs it: one announcement per reservation, the redelivery announced never.
#![cfg(feature = "mqtt")]

mod common;

use std::process::Stdio;
use std::time::Duration;

#[test]
fn example_announces_each_reservation_once_with_a_stable_id() {
    let mut cmd = common::through_runner(&common::built_example("outbox"));
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let done = common::wait_for(Duration::from_secs(120), || child.try_wait().unwrap());
    if done.is_none() {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        done.is_some_and(|s| s.success()),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    let announcements: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.starts_with("stock/reserved/"))
        .collect();
    assert_eq!(announcements.len(), 3, "{stdout}");
    for (order, line) in ["42", "43", "44"].iter().zip(&announcements) {
        assert!(
            line.starts_with(&format!("stock/reserved/{order} ")),
            "{line}"
        );
        let id = edge_inbox::outbox_message_id(
            "inventory-reservation",
            None,
            &format!("evt-{order}-created"),
            0,
        );
        assert!(
            line.ends_with(&format!("message-id={id} producer=gateway-7")),
            "{line}"
        );
    }
    assert_eq!(
        lines.last().copied(),
        Some("received 3 announcements; outbox: 0 pending, 3 sent")
    );
}
