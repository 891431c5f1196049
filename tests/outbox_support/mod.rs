//! A plain MQTT 5 subscriber that records every publish it receives (with its user properties), on a
//! persistent session so that nothing published while it reconnects is lost.
#![allow(dead_code)]

pub mod relay;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Got {
    pub topic: String,
    pub payload: Vec<u8>,
    pub message_id: Option<String>,
    pub producer: Option<String>,
    pub content_type: Option<String>,
    pub user_properties: Vec<(String, String)>,
}

pub struct Subscriber {
    stop: Arc<AtomicBool>,
    got: Arc<Mutex<Vec<Got>>>,
    thread: Option<JoinHandle<()>>,
}

impl Subscriber {
    /// Connects, subscribes to `filter` at QoS1 and returns once the subscription is acknowledged.
    pub fn start(port: u16, client_id: &str, filter: &str) -> Subscriber {
        use rumqttc::v5::mqttbytes::v5::Packet;
        use rumqttc::v5::mqttbytes::QoS;
        use rumqttc::v5::{Client, Event, MqttOptions};
        let stop = Arc::new(AtomicBool::new(false));
        let got = Arc::new(Mutex::new(Vec::new()));
        let ready = Arc::new(AtomicBool::new(false));
        let mut o = MqttOptions::new(client_id, "127.0.0.1", port);
        o.set_clean_start(false)
            .set_keep_alive(Duration::from_secs(30));
        o.set_session_expiry_interval(Some(3600));
        let (client, mut conn) = Client::new(o, 64);
        let filter = filter.to_string();
        let thread = {
            let (stop, got, ready) = (stop.clone(), got.clone(), ready.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match conn.recv_timeout(Duration::from_millis(100)) {
                        // At every CONNACK, even with a session present: a first connection that ended before
                        // the broker read its SUBSCRIBE leaves a session without the subscription (seen under
                        // qemu on a loaded machine), and everything published to it is then lost.
                        Ok(Ok(Event::Incoming(Packet::ConnAck(_)))) => {
                            let _ = client.try_subscribe(filter.clone(), QoS::AtLeastOnce);
                        }
                        Ok(Ok(Event::Incoming(Packet::SubAck(_)))) => {
                            ready.store(true, Ordering::SeqCst)
                        }
                        Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                            let props = p.properties.clone().unwrap_or_default();
                            let prop = |name: &str| {
                                props
                                    .user_properties
                                    .iter()
                                    .find(|(k, _)| k == name)
                                    .map(|(_, v)| v.clone())
                            };
                            let g = Got {
                                topic: String::from_utf8_lossy(&p.topic).into_owned(),
                                payload: p.payload.to_vec(),
                                message_id: prop("message-id"),
                                producer: prop("producer"),
                                content_type: props.content_type.clone(),
                                user_properties: props.user_properties.clone(),
                            };
                            got.lock().unwrap().push(g);
                        }
                        Ok(Ok(_)) => {}
                        Ok(Err(_)) => std::thread::sleep(Duration::from_millis(100)),
                        Err(_) => {}
                    }
                }
                let _ = client.try_disconnect();
            })
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ready.load(Ordering::SeqCst) {
            assert!(
                Instant::now() < deadline,
                "subscriber {client_id} did not subscribe"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Subscriber {
            stop,
            got,
            thread: Some(thread),
        }
    }

    pub fn got(&self) -> Vec<Got> {
        self.got.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.got.lock().unwrap().len()
    }

    /// Distinct message ids received.
    pub fn ids(&self) -> BTreeSet<String> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .filter_map(|g| g.message_id.clone())
            .collect()
    }

    /// Every payload received for each message id.
    pub fn payloads_by_id(&self) -> BTreeMap<String, BTreeSet<Vec<u8>>> {
        let mut m: BTreeMap<String, BTreeSet<Vec<u8>>> = BTreeMap::new();
        for g in self.got.lock().unwrap().iter() {
            m.entry(g.message_id.clone().unwrap_or_default())
                .or_default()
                .insert(g.payload.clone());
        }
        m
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
