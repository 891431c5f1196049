//! The inventory example against mosquitto's own features: a TLS listener with a password file, and a
//! broker that is away while the run wants to exit.
use std::time::Duration;

use crate::broker::Broker;
use crate::inventory_support::{event, event_id, report, run_cmd, spawn_cmd, SCOPE};

const PASSWORD: &str = "s3cret-pw";

pub fn tls_and_a_password_from_a_file_or_the_environment_connect_and_the_password_is_never_logged()
{
    let (broker, _ca) = Broker::start_tls("gateway", PASSWORD);
    let ca = broker.dir.path().join("ca.crt");
    let ca = ca.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    let pw_file = dir.path().join("password");
    std::fs::write(&pw_file, format!("{PASSWORD}\n")).unwrap();
    // Private, or the example refuses it.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&pw_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let pw_file = pw_file.to_str().unwrap();
    let addr = broker.addr();
    let tls = ["--tls-ca", ca, "--username", "gateway"];
    // The idle limits below leave room for a TLS handshake logged at trace level under qemu (over a second on
    // armv7 on a loaded machine: the run then stopped before its first CONNACK).
    let run = |extra: &[&str], env_password: Option<&str>| {
        let mut flags = tls.to_vec();
        flags.extend_from_slice(extra);
        let mut cmd = run_cmd(&addr, &db, "inv-tls", &flags);
        cmd.env("RUST_LOG", "trace");
        match env_password {
            Some(p) => cmd.env("MQTT_PASSWORD", p),
            None => cmd.env_remove("MQTT_PASSWORD"),
        };
        let out = spawn_cmd(cmd).success(Duration::from_secs(120));
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            !stderr.contains(PASSWORD),
            "the password reached the log:\n{stderr}"
        );
        stderr
    };

    // The file wins over the variable; the connection settings are logged, the password redacted.
    let first = run(
        &["--password-file", pw_file, "--exit-when-idle", "3"],
        Some("wrong"),
    );
    assert!(first.contains("connected (session present"), "{first}");
    assert!(first.contains("<redacted>"), "{first}");

    let body = event(1, "T-1", 2, "created");
    for _ in 0..2 {
        broker.pub_cmd(&[
            "--cafile",
            ca,
            "-u",
            "gateway",
            "-P",
            PASSWORD,
            "-V",
            "5",
            "-t",
            "orders/1",
            "-m",
            &body,
            "-D",
            "publish",
            "user-property",
            "message-id",
            &event_id(1, "created"),
        ]);
    }
    // A wrong password from the environment, or a CA that did not sign the broker's certificate: errors
    // that retrying cannot heal. The run (without an idle limit, so it would otherwise run for ever) exits
    // non-zero at once, saying why; nothing consumed.
    let server_crt = broker.dir.path().join("server.crt");
    for (flags, password, cause) in [
        (tls.to_vec(), "wrong", "the broker refused the connection"),
        (
            vec![
                "--tls-ca",
                server_crt.to_str().unwrap(),
                "--username",
                "gateway",
            ],
            PASSWORD,
            "TLS handshake failed",
        ),
    ] {
        let mut cmd = run_cmd(&addr, &db, "inv-tls", &flags);
        cmd.env("MQTT_PASSWORD", password);
        let out = spawn_cmd(cmd).wait(Duration::from_secs(60));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert!(
            stderr.contains("MQTT connection failed") && stderr.contains(cause),
            "the error names the cause ({cause}):\n{stderr}"
        );
        assert!(!stderr.contains("connected (session present"), "{stderr}");
    }
    assert_eq!(report(&db)["processed"], 0);

    // The right one from the environment; the relay connects with the same TLS settings and login.
    run(&["--announce", "--exit-when-idle", "3"], Some(PASSWORD));
    let r = report(&db);
    assert_eq!(
        (
            &r["processed"],
            &r["duplicates"],
            &r["reserved"]["T-1"],
            &r["outbox_unsent"]
        ),
        (&1.into(), &1.into(), &2.into(), &0.into()),
        "{r}"
    );
}

pub fn an_idle_run_that_never_reaches_the_broker_fails_and_the_next_confirms_every_announcement() {
    let mut broker = Broker::mosquitto();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    // Announcements committed by an earlier run whose relay never got to send them.
    let mut inbox = edge_inbox::Inbox::open(&db, edge_inbox::Config::default()).unwrap();
    for i in 0..3 {
        let (id, body) = (event_id(i, "created"), event(i, "R-1", 1, "created"));
        let d = edge_inbox::Delivery::new(SCOPE, &id, "orders/1", body.as_bytes());
        inbox
            .process(
                &d,
                |tx: &mut edge_inbox::Tx<'_>, d: &edge_inbox::Delivery<'_>| {
                    tx.publish(
                        "stock/reserved/1",
                        d.payload,
                        edge_inbox::Qos::AtLeastOnce,
                        &edge_inbox::OutboxProperties::new(),
                    )?;
                    Ok(())
                },
            )
            .unwrap();
    }
    assert_eq!(inbox.outbox_backlog().unwrap().pending, 3);
    broker.stop();

    // Idle-bounded, and the broker never answers: an error (non-zero, saying so), not a quiet success.
    let addr = broker.addr();
    let run = || {
        let mut cmd = run_cmd(
            &addr,
            &db,
            "inv-away",
            &["--announce", "--exit-when-idle", "1"],
        );
        cmd.env("RUST_LOG", "info");
        spawn_cmd(cmd).wait(Duration::from_secs(60))
    };
    let out = run();
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains("no connection to the broker")
            && log.contains("succeeded before the idle limit"),
        "{log}"
    );
    assert_eq!(report(&db)["outbox_unsent"], 3, "{log}");

    // Once it is back, an idle run waits until the relay has confirmed every announcement.
    broker.start_again();
    let out = run();
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{log}");
    assert_eq!(report(&db)["outbox_unsent"], 0, "{log}");
}
