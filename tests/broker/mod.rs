//! A real broker on a free 127.0.0.1 port: mosquitto (generated config in a temp dir, killed on drop) or rumqttd
//! inside the test process.
//!
//! `EDGE_INBOX_LOCAL_BROKER` chooses what [`Broker::start`] runs: `mosquitto`, `embedded`, or `auto` (the default:
//! mosquitto when installed, else embedded). `EDGE_INBOX_MOSQUITTO` names the mosquitto executable (a path that
//! does not exist stands for a machine without it). Tests that need mosquitto itself (a restart with
//! persistence, its log, TLS, ACLs, `mosquitto_pub`) live in the `mosquitto_only` target, or are marked
//! `Needs::Mosquitto` in a mixed `harness = false` target ([`run_tests`]); both report them
//! ignored when mosquitto is missing, unless `EDGE_INBOX_LOCAL_BROKER=mosquitto` demands it.
#![allow(dead_code)]

#[path = "../../examples/support/embedded.rs"]
mod embedded;

pub mod consumer;

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Why mosquitto-only tests are ignored on a machine without it.
pub const MOSQUITTO_MISSING: &str =
    "mosquitto not installed: apt-get install mosquitto mosquitto-clients";

/// The mosquitto executable: `EDGE_INBOX_MOSQUITTO` when set, else `mosquitto` on `PATH`, else
/// `/usr/sbin/mosquitto`; `None` when that file does not exist.
pub fn mosquitto_exe() -> Option<PathBuf> {
    if let Some(exe) = std::env::var_os("EDGE_INBOX_MOSQUITTO") {
        let exe = PathBuf::from(exe);
        return exe.is_file().then_some(exe);
    }
    on_path("mosquitto").or_else(|| {
        let p = PathBuf::from("/usr/sbin/mosquitto");
        p.is_file().then_some(p)
    })
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

pub fn mosquitto_path() -> PathBuf {
    mosquitto_exe().expect(MOSQUITTO_MISSING)
}

/// A mosquitto client program (`mosquitto_pub`, `mosquitto_passwd`): beside the broker, on `PATH`, or in
/// `/usr/bin`.
pub fn mosquitto_tool(name: &str) -> Option<PathBuf> {
    let exe = mosquitto_exe()?;
    let beside = exe.with_file_name(name);
    if beside.is_file() {
        return Some(beside);
    }
    on_path(name).or_else(|| {
        let p = Path::new("/usr/bin").join(name);
        p.is_file().then_some(p)
    })
}

/// What the mosquitto-only tests need and this machine lacks (`None`: everything is there).
pub fn mosquitto_missing() -> Option<String> {
    if mosquitto_exe().is_none() {
        return Some(MOSQUITTO_MISSING.into());
    }
    let missing: Vec<&str> = ["mosquitto_pub", "mosquitto_passwd"]
        .into_iter()
        .filter(|t| mosquitto_tool(t).is_none())
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "{} not installed: apt-get install mosquitto-clients",
            missing.join(", ")
        )
    })
}

/// The broker implementation a test runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Mosquitto,
    /// rumqttd in this process.
    Embedded,
}

/// What `EDGE_INBOX_LOCAL_BROKER` selects (see the module docs).
pub fn selected() -> Kind {
    match std::env::var("EDGE_INBOX_LOCAL_BROKER")
        .unwrap_or_default()
        .as_str()
    {
        "mosquitto" => Kind::Mosquitto,
        "embedded" => Kind::Embedded,
        "" | "auto" if mosquitto_exe().is_some() => Kind::Mosquitto,
        "" | "auto" => Kind::Embedded,
        other => panic!("EDGE_INBOX_LOCAL_BROKER={other:?}: expected auto, mosquitto or embedded"),
    }
}

/// Runs the mosquitto-only tests (a `harness = false` target): each runs when mosquitto is installed, and is
/// reported ignored, with the reason, when it is not, unless `EDGE_INBOX_LOCAL_BROKER=mosquitto` (CI), where a
/// missing mosquitto fails them.
pub fn run_mosquitto_only(tests: &[(&'static str, fn())]) -> ! {
    let tests: Vec<_> = tests
        .iter()
        .map(|&(n, t)| (n, t, Needs::Mosquitto))
        .collect();
    run_tests(&tests)
}

/// What a test of a mixed target (`harness = false`) needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Needs {
    /// Any broker: the selected one ([`Broker::start`]).
    AnyBroker,
    /// mosquitto itself (its log, a restart, its options): ignored with the reason where it is missing.
    Mosquitto,
}

/// Runs the tests of a `harness = false` target: those that need only a broker always run; those that need
/// mosquitto itself run as in [`run_mosquitto_only`].
pub fn run_tests(tests: &[(&'static str, fn(), Needs)]) -> ! {
    let args = libtest_mimic::Arguments::from_args();
    let missing = mosquitto_missing();
    let demanded = std::env::var("EDGE_INBOX_LOCAL_BROKER").as_deref() == Ok("mosquitto");
    let trials = tests
        .iter()
        .map(|&(name, test, needs)| {
            let missing = missing.clone().filter(|_| needs == Needs::Mosquitto);
            libtest_mimic::Trial::ignorable_test(name, move || match missing {
                Some(why) if demanded => {
                    Err(format!("EDGE_INBOX_LOCAL_BROKER=mosquitto, but {why}").into())
                }
                Some(why) => Ok(libtest_mimic::Completion::ignored_with(why)),
                None => {
                    test();
                    Ok(libtest_mimic::Completion::Completed)
                }
            })
        })
        .collect();
    libtest_mimic::run(&args, trials).exit()
}

/// Whether the process `pid` holds the socket listening on 127.0.0.1:`port` (`/proc/net/tcp` and the
/// process's descriptors); `None` where that cannot be read (another user's process, another system).
fn listener_owned_by(pid: u32, port: u16) -> Option<bool> {
    let tcp = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let local = format!(":{port:04X}");
    // Fields: slot, local address, remote address, state (0A: listening), ..., inode (the tenth).
    let sockets: Vec<String> = tcp
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() > 9 && f[1].ends_with(&local) && f[3] == "0A")
                .then(|| format!("socket:[{}]", f[9]))
        })
        .collect();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    Some(fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .ok()
            .is_some_and(|target| sockets.iter().any(|s| target.as_os_str() == s.as_str()))
    }))
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Broker {
    pub port: u16,
    pub dir: tempfile::TempDir,
    /// The implementation serving.
    pub kind: Kind,
    embedded: Option<embedded::Embedded>,
    child: Option<Child>,
    max_inflight: u16,
    verbose: bool,
    /// Listener options appended to the generated config (TLS, authentication).
    extra: String,
    /// Whether sessions and queued deliveries survive a restart.
    persistence: bool,
}

impl Broker {
    /// The selected broker ([`selected`]); mosquitto runs with persistence on (so a restart keeps sessions and
    /// queued deliveries).
    pub fn start() -> Broker {
        Broker::start_with(20)
    }

    /// Like [`Broker::start`]; mosquitto sends at most `max_inflight` unacked QoS1 deliveries per client
    /// (rumqttd's limit is fixed at 100).
    pub fn start_with(max_inflight: u16) -> Broker {
        match selected() {
            Kind::Mosquitto => Broker::mosquitto_with(max_inflight),
            Kind::Embedded => Broker::embedded(),
        }
    }

    /// rumqttd in this process, on a free loopback port; it runs until the test process exits.
    pub fn embedded() -> Broker {
        let e = embedded::Embedded::start().expect("start the embedded broker");
        Broker {
            port: e.port,
            embedded: Some(e),
            dir: tempfile::tempdir().unwrap(),
            kind: Kind::Embedded,
            child: None,
            max_inflight: 100,
            verbose: false,
            extra: String::new(),
            persistence: false,
        }
    }

    /// mosquitto with persistence, whatever [`selected`] says.
    pub fn mosquitto() -> Broker {
        Broker::mosquitto_with(20)
    }

    /// mosquitto, whatever [`selected`] says.
    pub fn mosquitto_with(max_inflight: u16) -> Broker {
        let dir = tempfile::tempdir().unwrap();
        let mut b = Broker {
            port: free_port(),
            dir,
            kind: Kind::Mosquitto,
            embedded: None,
            child: None,
            max_inflight,
            verbose: false,
            extra: String::new(),
            persistence: true,
        };
        b.spawn_fresh();
        b
    }

    /// A broker that applies `acl` (mosquitto's acl_file syntax) to anonymous clients.
    pub fn start_with_acl(acl: &str) -> Broker {
        let dir = tempfile::tempdir().unwrap();
        let acl_path = dir.path().join("acl");
        std::fs::write(&acl_path, acl).unwrap();
        let mut b = Broker {
            port: free_port(),
            extra: format!("acl_file {}\n", acl_path.display()),
            dir,
            kind: Kind::Mosquitto,
            embedded: None,
            child: None,
            max_inflight: 20,
            verbose: false,
            persistence: true,
        };
        b.spawn_fresh();
        b
    }

    /// A broker with `options` (mosquitto.conf lines, e.g. `max_packet_size 2048`) added to its config.
    pub fn start_with_options(options: &str) -> Broker {
        let dir = tempfile::tempdir().unwrap();
        let mut b = Broker {
            port: free_port(),
            extra: format!("{options}\n"),
            dir,
            kind: Kind::Mosquitto,
            embedded: None,
            child: None,
            max_inflight: 20,
            verbose: false,
            persistence: true,
        };
        b.spawn_fresh();
        b
    }

    /// The selected broker, as [`Broker::start`]; mosquitto logs every packet (a failing test can show
    /// what the broker received).
    pub fn start_logged() -> Broker {
        match selected() {
            Kind::Mosquitto => Broker::start_verbose(20),
            Kind::Embedded => Broker::embedded(),
        }
    }

    /// A broker that logs every packet (to check ack order from the broker's side).
    pub fn start_verbose(max_inflight: u16) -> Broker {
        let dir = tempfile::tempdir().unwrap();
        let mut b = Broker {
            port: free_port(),
            dir,
            kind: Kind::Mosquitto,
            embedded: None,
            child: None,
            max_inflight,
            verbose: true,
            extra: String::new(),
            persistence: true,
        };
        b.spawn_fresh();
        b
    }

    /// A broker without persistence that logs every packet: a restart forgets every session.
    pub fn start_volatile_verbose(max_inflight: u16) -> Broker {
        let dir = tempfile::tempdir().unwrap();
        let mut b = Broker {
            port: free_port(),
            dir,
            kind: Kind::Mosquitto,
            embedded: None,
            child: None,
            max_inflight,
            verbose: true,
            extra: String::new(),
            persistence: false,
        };
        b.spawn_fresh();
        b
    }

    /// Kills the broker (SIGKILL: connections drop at once, nothing is saved).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills mosquitto and starts it again on the same port with `options` (mosquitto.conf lines) in place
    /// of the extra options it had; its persistence file (sessions, queued deliveries) stays.
    pub fn restart_with_options(&mut self, options: &str) {
        self.kill();
        self.extra = format!("{options}\n");
        self.spawn();
    }

    /// Starts the broker again on the same port (after [`Broker::kill`] or [`Broker::stop`]).
    pub fn start_again(&mut self) {
        self.spawn();
    }

    /// Starts mosquitto on a new broker's port, or on another free port when that one was taken before
    /// mosquitto could bind it (`free_port` lets it go, and another test's broker or client may get it
    /// meanwhile; the connection check alone would then see the other listener).
    fn spawn_fresh(&mut self) {
        for _ in 0..5 {
            if self.try_spawn() {
                return;
            }
            self.kill();
            self.port = free_port();
        }
        panic!("mosquitto could not listen on a free port in 5 tries");
    }

    /// Starts mosquitto again on its port, which it must get.
    fn spawn(&mut self) {
        assert!(
            self.try_spawn(),
            "mosquitto did not listen on {}",
            self.port
        );
    }

    /// Starts mosquitto and waits until it listens on `self.port` itself: false when it ended first (the
    /// port was taken) or did not listen within 10 s.
    fn try_spawn(&mut self) -> bool {
        assert_eq!(
            self.kind,
            Kind::Mosquitto,
            "only mosquitto runs as a child process"
        );
        // Started as root, mosquitto drops to its own user: it must be able to write its persistence file
        // and log here.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(self.dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let conf = self.dir.path().join("mosquitto.conf");
        let config = format!(
            "listener {} 127.0.0.1\nallow_anonymous {}\npersistence {}\npersistence_location {}/\n\
             autosave_interval 1\nmax_inflight_messages {}\nmax_queued_messages 100000\n\
             log_dest file {}/mosquitto.log\nlog_type error\nlog_type warning\nlog_type notice\n",
            self.port,
            !self.extra.contains("password_file"),
            self.persistence,
            self.dir.path().display(),
            self.max_inflight,
            self.dir.path().display()
        );
        let config = if self.verbose {
            config + "log_type debug\n"
        } else {
            config
        };
        std::fs::write(&conf, config + &self.extra).unwrap();
        let child = Command::new(mosquitto_path())
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start mosquitto");
        let pid = child.id();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(Ok(Some(_))) = self.child.as_mut().map(Child::try_wait) {
                // It could not bind the port.
                return false;
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                && listener_owned_by(pid, self.port) != Some(false)
            {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A broker with a TLS listener (certificates made here with openssl, SAN IP:127.0.0.1) and password
    /// authentication for `user`/`password`. Returns the broker and the CA certificate (PEM).
    pub fn start_tls(user: &str, password: &str) -> (Broker, Vec<u8>) {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let run = |args: &[&str]| {
            let out = Command::new(args[0])
                .args(&args[1..])
                .current_dir(d)
                .output()
                .expect(args[0]);
            assert!(
                out.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        std::fs::write(d.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let mut ca = vec!["openssl", "req", "-x509"];
        ca.extend(ec);
        ca.extend([
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=edge-inbox test CA",
        ]);
        run(&ca);
        let mut csr = vec!["openssl", "req"];
        csr.extend(ec);
        csr.extend([
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ]);
        run(&csr);
        run(&[
            "openssl",
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "san.ext",
        ]);
        let passwd = mosquitto_tool("mosquitto_passwd").expect("mosquitto_passwd");
        let passwd = passwd.to_str().unwrap();
        run(&[passwd, "-b", "-c", "passwd", user, password]);
        use std::os::unix::fs::PermissionsExt;
        for f in ["ca.crt", "server.crt", "server.key", "passwd"] {
            std::fs::set_permissions(d.join(f), std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        let extra = format!(
            "cafile {0}/ca.crt\ncertfile {0}/server.crt\nkeyfile {0}/server.key\npassword_file {0}/passwd\n",
            d.display()
        );
        let ca_pem = std::fs::read(d.join("ca.crt")).unwrap();
        let mut b = Broker {
            port: free_port(),
            dir,
            kind: Kind::Mosquitto,
            embedded: None,
            child: None,
            max_inflight: 20,
            verbose: false,
            extra,
            persistence: true,
        };
        b.spawn_fresh();
        (b, ca_pem)
    }

    /// Stops the broker gracefully (SIGTERM: it saves its persistence file) and starts it again on the same
    /// port with the same state.
    pub fn restart(&mut self) {
        assert_eq!(
            self.kind,
            Kind::Mosquitto,
            "a restart with persistence needs mosquitto"
        );
        self.stop();
        self.spawn();
    }

    /// Ends every client connection under the clients' feet: mosquitto restarts (its persistence keeps the
    /// sessions), the embedded broker closes them (its memory keeps the sessions). Either way the unacked
    /// deliveries come again on the reconnect.
    pub fn drop_connections(&mut self) {
        match &self.embedded {
            Some(e) => e.drop_connections(),
            None => self.restart(),
        }
    }

    pub fn stop(&mut self) {
        assert_eq!(
            self.kind,
            Kind::Mosquitto,
            "stopping a broker needs mosquitto"
        );
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(c.id().to_string())
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if c.try_wait().unwrap().is_some() {
                    break;
                }
                if Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `mosquitto_pub` with the given extra arguments (host and port added), bounded in time.
    pub fn pub_cmd(&self, args: &[&str]) -> Output {
        let mut child = Command::new(mosquitto_tool("mosquitto_pub").expect(MOSQUITTO_MISSING))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q", "1"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("mosquitto_pub");
        let deadline = Instant::now() + Duration::from_secs(20);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "mosquitto_pub {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// Publishes one QoS1 message with MQTT 5 user property `message-id` (when given): with `mosquitto_pub`
    /// to mosquitto, with rumqttc to the embedded broker.
    pub fn publish_v5(&self, topic: &str, id: Option<&str>, payload: &str) {
        if self.kind == Kind::Embedded {
            return publish_v5(self.port, &[Msg::new(topic, id, payload)]);
        }
        let mut args = vec!["-V", "5", "-t", topic, "-m", payload];
        if let Some(id) = id {
            args.extend(["-D", "publish", "user-property", "message-id", id]);
        }
        self.pub_cmd(&args);
    }

    /// Publishes many lines as separate QoS1 messages (`-l`), each with the same properties.
    pub fn publish_lines_v5(&self, topic: &str, id: &str, lines: &str) {
        let mut child = Command::new(mosquitto_tool("mosquitto_pub").expect(MOSQUITTO_MISSING))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-q",
                "1",
                "-V",
                "5",
                "-t",
                topic,
                "-l",
            ])
            .args(["-D", "publish", "user-property", "message-id", id])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(lines.as_bytes())
            .unwrap();
        assert!(child.wait().unwrap().success());
    }

    /// mosquitto's log (empty for the embedded broker, which keeps none).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("mosquitto.log")).unwrap_or_default()
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One message for [`publish_v5`]: topic, optional `message-id`, optional `producer`, payload.
#[derive(Clone)]
pub struct Msg {
    pub topic: String,
    pub id: Option<String>,
    pub producer: Option<String>,
    pub payload: Vec<u8>,
}

impl Msg {
    pub fn new(topic: &str, id: Option<&str>, payload: impl Into<Vec<u8>>) -> Msg {
        Msg {
            topic: topic.into(),
            id: id.map(Into::into),
            producer: None,
            payload: payload.into(),
        }
    }
}

/// Publishes with rumqttc over MQTT 5 at QoS1 and waits (bounded) for every PUBACK.
pub fn publish_v5(port: u16, msgs: &[Msg]) {
    use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::{Client, Event, MqttOptions};
    let mut o = MqttOptions::new(
        format!("pub-{}-{}", std::process::id(), free_port()),
        "127.0.0.1",
        port,
    );
    o.set_keep_alive(Duration::from_secs(30));
    let (client, mut conn) = Client::new(o, 64);
    let total = msgs.len();
    let publisher = {
        let client = client.clone();
        let msgs = msgs.to_vec();
        std::thread::spawn(move || {
            for Msg {
                topic,
                id,
                producer,
                payload,
            } in msgs
            {
                let mut props = PublishProperties::default();
                if let Some(id) = id {
                    props.user_properties.push(("message-id".into(), id));
                }
                if let Some(p) = producer {
                    props.user_properties.push(("producer".into(), p));
                }
                if client
                    .publish_with_properties(topic, QoS::AtLeastOnce, false, payload, props)
                    .is_err()
                {
                    return;
                }
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut acked = 0;
    while acked < total {
        assert!(
            Instant::now() < deadline,
            "publisher: only {acked} of {total} PUBACKs"
        );
        match conn.recv_timeout(Duration::from_millis(500)) {
            Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => acked += 1,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                // The broker may be restarting; rumqttc republishes unacked messages after reconnecting.
                eprintln!("publisher connection error: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(_) => {}
        }
    }
    let _ = publisher.join();
    let _ = client.disconnect();
}

/// Publishes CBOR envelopes with rumqttc over MQTT 3.1.1 at QoS1 and waits for every PUBACK.
pub fn publish_v311(port: u16, msgs: &[(String, Vec<u8>)]) {
    use rumqttc::{Client, Event, MqttOptions, Packet, QoS};
    let mut o = MqttOptions::new(
        format!("pub4-{}-{}", std::process::id(), free_port()),
        "127.0.0.1",
        port,
    );
    o.set_keep_alive(Duration::from_secs(30));
    let (client, mut conn) = Client::new(o, 64);
    let total = msgs.len();
    let publisher = {
        let client = client.clone();
        let msgs = msgs.to_vec();
        std::thread::spawn(move || {
            for (topic, payload) in msgs {
                if client
                    .publish(topic, QoS::AtLeastOnce, false, payload)
                    .is_err()
                {
                    return;
                }
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut acked = 0;
    while acked < total {
        assert!(
            Instant::now() < deadline,
            "publisher: only {acked} of {total} PUBACKs"
        );
        match conn.recv_timeout(Duration::from_millis(500)) {
            Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => acked += 1,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                eprintln!("publisher connection error: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(_) => {}
        }
    }
    let _ = publisher.join();
    let _ = client.disconnect();
}

/// The inventory handler of the seed scenario: JSON `{"order","sku","qty","kind"}`; `created` reserves,
/// `cancelled` releases, in the built-in KV state under `reserved/<sku>`.
pub fn inventory_handler(
    tx: &mut edge_inbox::Tx<'_>,
    d: &edge_inbox::Delivery<'_>,
) -> anyhow::Result<()> {
    let v: serde_json::Value = serde_json::from_slice(d.payload)?;
    let sku = v["sku"].as_str().ok_or_else(|| anyhow::anyhow!("no sku"))?;
    let qty = v["qty"].as_i64().ok_or_else(|| anyhow::anyhow!("no qty"))?;
    let sign = match v["kind"].as_str() {
        Some("created") => 1,
        Some("cancelled") => -1,
        other => anyhow::bail!("unknown kind {other:?}"),
    };
    let key = format!("reserved/{sku}");
    let now: i64 = tx.get(&key)?.unwrap_or(0);
    tx.put(&key, &(now + sign * qty))?;
    Ok(())
}

/// Reads `reserved/<sku>` for the scope from the database.
pub fn reserved(db: &Path, scope: &str, sku: &str) -> i64 {
    let conn = rusqlite::Connection::open(db).unwrap();
    let blob: Option<Vec<u8>> = conn
        .query_row(
            "SELECT value FROM kv WHERE ns = ?1 AND key = ?2",
            (scope, format!("reserved/{sku}")),
            |r| r.get(0),
        )
        .ok();
    blob.map(|b| ciborium::from_reader(&b[..]).unwrap())
        .unwrap_or(0)
}
