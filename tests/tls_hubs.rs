//! TLS as cloud hubs need it, emulated with mosquitto: client certificates (`require_certificate true`),
//! the system's roots, a server name override, both MQTT versions through the inventory example, and a
//! process-wide rustls provider the crate neither reads nor changes. Certificates are made here with
//! `openssl`. Tests that need mosquitto are reported ignored, with the reason, where it is missing.

mod broker;
mod common;
mod inventory_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use broker::{inventory_handler, Broker, Needs};
use edge_inbox::{
    Config, Consumer, Envelope, Inbox, MqttConfig, Protocol, TlsConfig, TlsConfigError,
};
use inventory_support::{event, event_id, report, run_cmd, spawn_cmd, SCOPE};

/// Certificates made with openssl in a temporary directory readable by mosquitto.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn p(&self, name: &str) -> String {
        self.path(name).to_str().unwrap().to_owned()
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn ca(&self, name: &str) {
        self.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-subj",
            &format!("/CN=edge-inbox {name}"),
        ]);
    }

    /// A certificate `name.crt` (EC P-256 key `name.key`, PKCS#8) signed by `ca`, valid for `days` (-1:
    /// expired), with the extensions in `ext` (none when empty).
    fn leaf(&self, name: &str, ca: &str, days: &str, ext: &str) {
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={name}"),
        ]);
        let ext_file = format!("{name}.ext");
        std::fs::write(self.path(&ext_file), format!("{ext}\n")).unwrap();
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &format!("{name}.crt"),
            "-days",
            days,
            "-extfile",
            &ext_file,
        ]);
    }

    /// A CA, a server certificate for 127.0.0.1 (and DNS `broker.test`, or only that with `dns_only`),
    /// a good client, a client of another CA, an expired client.
    fn new(dns_only: bool) -> Pki {
        let pki = Pki {
            dir: tempfile::tempdir().unwrap(),
        };
        pki.ca("ca");
        pki.ca("other-ca");
        let san = if dns_only {
            "subjectAltName=DNS:broker.test"
        } else {
            "subjectAltName=IP:127.0.0.1,DNS:broker.test"
        };
        pki.leaf("server", "ca", "2", san);
        pki.leaf("client", "ca", "2", "extendedKeyUsage=clientAuth");
        pki.leaf("stranger", "other-ca", "2", "extendedKeyUsage=clientAuth");
        pki.leaf("expired", "ca", "-1", "extendedKeyUsage=clientAuth");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(pki.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        for e in std::fs::read_dir(pki.dir.path()).unwrap() {
            std::fs::set_permissions(e.unwrap().path(), std::fs::Permissions::from_mode(0o644))
                .unwrap();
        }
        pki
    }

    /// mosquitto with a TLS listener that requires a client certificate signed by `ca`, plus `extra`.
    fn broker(&self, require_certificate: bool, extra: &str) -> Broker {
        Broker::start_with_options(&format!(
            "cafile {}\ncertfile {}\nkeyfile {}\nrequire_certificate {require_certificate}\n{extra}",
            self.p("ca.crt"),
            self.p("server.crt"),
            self.p("server.key")
        ))
    }
}

// --- Checked when built -------------------------------------------------------------------------------

fn build_err(b: edge_inbox::TlsConfigBuilder) -> String {
    match b.build() {
        Ok(_) => panic!("the TLS config must not build"),
        Err(e) => e.to_string(),
    }
}

fn material_is_checked_when_the_config_is_built_and_errors_name_the_file() {
    let pki = Pki::new(false);
    let base = || TlsConfig::builder().ca_file(pki.path("ca.crt"));
    // The three key formats a device is likely to hold.
    pki.openssl(&["ec", "-in", "client.key", "-out", "client.sec1.key"]);
    assert!(std::fs::read_to_string(pki.path("client.sec1.key"))
        .unwrap()
        .contains("BEGIN EC PRIVATE KEY"));
    pki.openssl(&[
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "rsa.key", "-out", "rsa.crt",
        "-days", "2", "-subj", "/CN=rsa",
    ]);
    pki.openssl(&[
        "rsa",
        "-in",
        "rsa.key",
        "-traditional",
        "-out",
        "rsa.pkcs1.key",
    ]);
    assert!(std::fs::read_to_string(pki.path("rsa.pkcs1.key"))
        .unwrap()
        .contains("BEGIN RSA PRIVATE KEY"));
    for (cert, key) in [
        ("client.crt", "client.key"),
        ("client.crt", "client.sec1.key"),
        ("rsa.crt", "rsa.key"),
        ("rsa.crt", "rsa.pkcs1.key"),
    ] {
        base()
            .client_cert_file(pki.path(cert))
            .client_key_file(pki.path(key))
            .build()
            .unwrap_or_else(|e| panic!("{cert} + {key}: {e}"));
    }

    // A key that is not the certificate's: an error now, naming both files.
    let e = build_err(
        base()
            .client_cert_file(pki.path("client.crt"))
            .client_key_file(pki.path("stranger.key")),
    );
    assert!(
        e.contains("does not match") && e.contains("stranger.key") && e.contains("client.crt"),
        "{e}"
    );
    // Swapped certificate and key.
    let e = build_err(
        base()
            .client_cert_file(pki.path("client.key"))
            .client_key_file(pki.path("client.crt")),
    );
    assert!(e.contains("client.key") && e.contains("swapped"), "{e}");
    // A missing file, a CA file that holds no certificate, a certificate without its key.
    let e = build_err(TlsConfig::builder().ca_file(pki.path("nope.crt")));
    assert!(e.contains("nope.crt"), "{e}");
    let e = build_err(TlsConfig::builder().ca_file(pki.path("server.ext")));
    assert!(
        e.contains("server.ext") && e.contains("no PEM certificate"),
        "{e}"
    );
    let e = build_err(base().client_cert_file(pki.path("client.crt")));
    assert!(e.contains("needs a client key"), "{e}");
    assert!(matches!(
        TlsConfig::builder().build(),
        Err(TlsConfigError::NoTrustAnchor)
    ));
    // The key never shows in Debug output.
    let cfg = base()
        .client_cert_file(pki.path("client.crt"))
        .client_key_file(pki.path("client.key"))
        .build()
        .unwrap();
    let key = std::fs::read_to_string(pki.path("client.key")).unwrap();
    let body = key.lines().nth(1).unwrap();
    assert!(!format!("{cfg:?}").contains(body), "{cfg:?}");
}

// --- Against mosquitto -----------------------------------------------------------------------------------

/// A consumer that ends once idle for `idle`. The limit also bounds the wait for the first CONNACK, and a TLS
/// handshake under qemu takes over a second: the cases that must connect allow 3 s.
fn consumer(port: u16, db: &Path, tls: TlsConfig, protocol: Protocol, idle: Duration) -> Consumer {
    let mqtt = MqttConfig::new("127.0.0.1", port, "hub-lib")
        .protocol(protocol)
        .subscribe("orders/#")
        .tls(tls);
    Consumer::new(Inbox::open(db, Config::default()).unwrap(), SCOPE, mqtt).exit_when_idle(idle)
}

const CONNECTS_IDLE: Duration = Duration::from_secs(3);

fn a_server_name_override_verifies_the_name_the_certificate_carries() {
    let pki = Pki::new(true);
    let broker = pki.broker(false, "");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inbox.db");
    let tls = |name: Option<&str>| {
        let b = TlsConfig::builder().ca_file(pki.path("ca.crt"));
        match name {
            Some(n) => b.server_name(n),
            None => b,
        }
        .build()
        .unwrap()
    };
    // The certificate names broker.test only: connecting to 127.0.0.1 fails, for that reason. The idle limit
    // is far off, so only the handshake's failure can end this run.
    let mut refused = consumer(
        broker.port,
        &db,
        tls(None),
        Protocol::V5,
        Duration::from_secs(120),
    );
    match refused.run(inventory_handler) {
        Err(edge_inbox::Error::Connection(why)) => {
            assert!(why.contains("not valid for name"), "{why}")
        }
        other => panic!("a certificate for another name must not connect: {other:?}"),
    }
    let s = consumer(
        broker.port,
        &db,
        tls(Some("broker.test")),
        Protocol::V5,
        CONNECTS_IDLE,
    )
    .run(inventory_handler)
    .unwrap();
    assert!(s.connections >= 1, "{s:?}");
}

fn publish(broker: &Broker, pki: &Pki, protocol: &str, order: u64) {
    let body = event(order, "H-1", 1, "created");
    let id = event_id(order, "created");
    let (cafile, cert, key) = (pki.p("ca.crt"), pki.p("client.crt"), pki.p("client.key"));
    let mut args = vec![
        "--cafile", &cafile, "--cert", &cert, "--key", &key, "-t", "orders/1",
    ];
    let envelope = pki.path(&format!("envelope-{order}"));
    let envelope_s = envelope.to_str().unwrap().to_owned();
    match protocol {
        "v311" => {
            std::fs::write(&envelope, Envelope::new(&id, body.into_bytes()).encode()).unwrap();
            args.extend(["-V", "311", "-f", &envelope_s]);
            broker.pub_cmd(&args);
        }
        _ => {
            args.extend([
                "-V",
                "5",
                "-m",
                &body,
                "-D",
                "publish",
                "user-property",
                "message-id",
                &id,
            ]);
            broker.pub_cmd(&args);
        }
    }
}

fn inventory_with_client_certificates_on_both_protocols() {
    let pki = Pki::new(false);
    let broker = pki.broker(true, "");
    let addr = broker.addr();
    let ca = pki.p("ca.crt");
    for protocol in ["v5", "v311"] {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("inv.db");
        let client_id = format!("inv-hub-{protocol}");
        let tls = |cert: &str, key: &str| {
            vec![
                "--tls-ca".to_owned(),
                ca.clone(),
                "--tls-cert".into(),
                pki.p(cert),
                "--tls-key".into(),
                pki.p(key),
                "--protocol".into(),
                protocol.into(),
            ]
        };
        // Rejected certificates, and a key that is not the certificate's: no idle limit, so only failing
        // fast ends the run; it must end non-zero and name the cause.
        for (cert, key, cause) in [
            ("stranger.crt", "stranger.key", "UnknownCA"),
            ("expired.crt", "expired.key", "CertificateExpired"),
            (
                "client.crt",
                "stranger.key",
                "does not match the certificate",
            ),
        ] {
            let flags = tls(cert, key);
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            let out =
                spawn_cmd(run_cmd(&addr, &db, &client_id, &flags)).wait(Duration::from_secs(60));
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{protocol} {cert} {key}: {stderr}");
            assert!(
                stderr.contains(cause),
                "{protocol} {cert} {key}: the error names the cause ({cause}):\n{stderr}"
            );
            assert!(!stderr.contains("connected (session present"), "{stderr}");
        }

        // The right certificate: the first run makes the session, the second consumes what was sent.
        let mut flags = tls("client.crt", "client.key");
        flags.extend([
            "--alpn".into(),
            "mqtt".into(),
            "--exit-when-idle".into(),
            "1".into(),
        ]);
        if protocol == "v5" {
            flags.push("--announce".into());
        }
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let run = || {
            let mut cmd = run_cmd(&addr, &db, &client_id, &flags);
            cmd.env("RUST_LOG", "info");
            spawn_cmd(cmd).success(Duration::from_secs(120))
        };
        run();
        publish(&broker, &pki, protocol, 7);
        publish(&broker, &pki, protocol, 7);
        run();
        let r = report(&db);
        assert_eq!(
            (
                &r["processed"],
                &r["duplicates"],
                &r["reserved"]["H-1"],
                &r["outbox_unsent"]
            ),
            (&1.into(), &1.into(), &1.into(), &0.into()),
            "{protocol}: {r}\n{}",
            broker.log()
        );
    }
}

fn inventory_trusts_the_system_roots_when_asked() {
    let pki = Pki::new(false);
    let broker = pki.broker(true, "");
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("inv.db");
    let (cert, key) = (pki.p("client.crt"), pki.p("client.key"));
    let flags = [
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--exit-when-idle",
        "1",
    ];
    let run = |roots: bool, cert_file: Option<&Path>| {
        let mut f = flags.to_vec();
        if roots {
            f.push("--tls-system-roots");
        }
        let mut cmd = run_cmd(&broker.addr(), &db, "inv-roots", &f);
        // rustls-native-certs reads these before the platform's store: "the system" is our CA here.
        cmd.env_remove("SSL_CERT_DIR");
        match cert_file {
            Some(p) => cmd.env("SSL_CERT_FILE", p),
            None => cmd.env_remove("SSL_CERT_FILE"),
        };
        spawn_cmd(cmd).wait(Duration::from_secs(60))
    };
    let out = run(false, None);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("nothing to verify the broker with"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(true, Some(&pki.path("ca.crt")));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The system's roots do not include a private test CA.
    let out = run(true, Some(&pki.path("other-ca.crt")));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("UnknownIssuer"),
        "{stderr}"
    );
}

// --- The process-wide provider: each case in a process of its own ---------------------------------------

const CHILD: &str = "TLS_HUBS_CHILD";

/// Runs `case` in a child process (a fresh process-wide provider state) against a broker that accepts
/// only the TLS 1.3 AES-GCM suites.
fn in_child(case: &str) {
    let pki = Pki::new(false);
    let broker = pki.broker(
        false,
        "tls_version tlsv1.3\nciphers_tls1.3 TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384\n",
    );
    let exe = std::env::current_exe().unwrap();
    let out = common::through_runner(&exe)
        .env(CHILD, case)
        .env("TLS_HUBS_PORT", broker.port.to_string())
        .env("TLS_HUBS_CA", pki.path("ca.crt"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{case}: {}\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        broker.log()
    );
}

fn child_consumes() -> edge_inbox::RunSummary {
    let port: u16 = std::env::var("TLS_HUBS_PORT").unwrap().parse().unwrap();
    let ca = std::env::var("TLS_HUBS_CA").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tls = TlsConfig::builder().ca_file(ca).build().unwrap();
    let s = consumer(
        port,
        &dir.path().join("inbox.db"),
        tls,
        Protocol::V5,
        CONNECTS_IDLE,
    )
    .run(inventory_handler)
    .unwrap();
    assert!(s.connections >= 1, "{s:?}");
    s
}

fn child_case(case: &str) {
    use rustls::crypto::CryptoProvider;
    match case {
        "app-provider" => {
            // The application's own default: ring with ChaCha20 only, which this broker does not accept.
            let mut provider = rustls::crypto::ring::default_provider();
            provider.cipher_suites =
                vec![rustls::crypto::ring::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256];
            provider.install_default().unwrap();
            let mine = CryptoProvider::get_default().unwrap().clone();
            child_consumes();
            assert!(Arc::ptr_eq(CryptoProvider::get_default().unwrap(), &mine));
        }
        "no-provider" => {
            assert!(CryptoProvider::get_default().is_none());
            child_consumes();
            assert!(
                CryptoProvider::get_default().is_none(),
                "the consumer installed a process-wide provider"
            );
        }
        other => panic!("unknown case {other}"),
    }
}

fn the_applications_provider_stays_the_default_and_the_crate_uses_its_own() {
    in_child("app-provider");
}

fn a_run_without_a_default_provider_leaves_none_installed() {
    in_child("no-provider");
}

fn main() {
    if let Ok(case) = std::env::var(CHILD) {
        let _ = env_logger::builder().is_test(true).try_init();
        child_case(&case);
        return;
    }
    broker::run_tests(&[
        (
            "material_is_checked_when_the_config_is_built_and_errors_name_the_file",
            material_is_checked_when_the_config_is_built_and_errors_name_the_file,
            Needs::AnyBroker,
        ),
        (
            "a_server_name_override_verifies_the_name_the_certificate_carries",
            a_server_name_override_verifies_the_name_the_certificate_carries,
            Needs::Mosquitto,
        ),
        (
            "inventory_with_client_certificates_on_both_protocols",
            inventory_with_client_certificates_on_both_protocols,
            Needs::Mosquitto,
        ),
        (
            "inventory_trusts_the_system_roots_when_asked",
            inventory_trusts_the_system_roots_when_asked,
            Needs::Mosquitto,
        ),
        (
            "the_applications_provider_stays_the_default_and_the_crate_uses_its_own",
            the_applications_provider_stays_the_default_and_the_crate_uses_its_own,
            Needs::Mosquitto,
        ),
        (
            "a_run_without_a_default_provider_leaves_none_installed",
            a_run_without_a_default_provider_leaves_none_installed,
            Needs::Mosquitto,
        ),
    ])
}
