//! TLS (rustls, ring provider) and username/password against a mosquitto TLS listener.
use std::time::{Duration, Instant};

use crate::broker::{inventory_handler, reserved, Broker};
use edge_inbox::{Config, Consumer, Inbox, MqttConfig, TlsConfig};

const SCOPE: &str = "inventory-reservation";

pub fn tls_with_password_consumes_and_a_wrong_password_never_connects() {
    let _ = env_logger::builder().is_test(true).try_init();
    let (broker, ca_pem) = Broker::start_tls("gateway", "s3cret-pw");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let port = broker.port;
    let ca_path = broker.dir.path().join("ca.crt");
    let tls = TlsConfig::builder().ca_pem(ca_pem).build().unwrap();
    let consumer = |password: &str, idle: u64| {
        let mqtt = MqttConfig::new("127.0.0.1", port, "inv-tls")
            .subscribe("orders/#")
            .credentials("gateway", password)
            .tls(tls.clone());
        assert!(
            !format!("{mqtt:?}").contains(password),
            "the password never shows in Debug output"
        );
        Consumer::new(Inbox::open(&db, Config::default()).unwrap(), SCOPE, mqtt)
            .exit_when_idle(Duration::from_millis(idle))
    };

    // A refused login cannot heal by retrying: the run ends at once with the cause, not idle with `Ok`.
    let started = Instant::now();
    let refused = consumer("wrong", 600_000).run(inventory_handler);
    match refused {
        Err(edge_inbox::Error::Connection(why)) => {
            assert!(
                why.contains("NotAuthorized") || why.contains("BadUserNamePassword"),
                "{why}"
            )
        }
        other => panic!("a wrong password must end the run with a connection error: {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(300),
        "ended before the idle limit"
    );

    // Idle time counts from the connection, whatever the handshake took (slow under an emulator).
    let first = consumer("s3cret-pw", 1000).run(inventory_handler).unwrap();
    assert!(first.connections >= 1, "{first:?}\n{}", broker.log());
    let body = r#"{"order":1,"sku":"T-1","qty":2,"kind":"created"}"#;
    for _ in 0..2 {
        broker.pub_cmd(&[
            "--cafile",
            ca_path.to_str().unwrap(),
            "-u",
            "gateway",
            "-P",
            "s3cret-pw",
            "-V",
            "5",
            "-t",
            "orders/1",
            "-m",
            body,
            "-D",
            "publish",
            "user-property",
            "message-id",
            "evt-1-created",
        ]);
    }
    let s = consumer("s3cret-pw", 1500).run(inventory_handler).unwrap();
    assert_eq!((s.processed, s.duplicates, s.acked), (1, 1, 2), "{s:?}");
    assert_eq!(reserved(&db, SCOPE, "T-1"), 2);
}
