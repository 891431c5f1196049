//! The firmware example (one rumqttc connection for telemetry and commands, the inbox fed from its event
//! loop) as a user runs it: commands applied once each, telemetry published on the same connection, SIGTERM,
//! and kill -9 at random moments with nothing lost or applied twice.
#![cfg(feature = "mqtt")]

mod broker;
mod common;
mod firmware_support;
mod inventory_support;
mod outbox_support;

const EXAMPLE: &str = "firmware";

#[test]
fn firmware_applies_each_command_once_and_publishes_telemetry_on_the_same_connection() {
    firmware_support::applies_each_command_once_and_publishes_telemetry(EXAMPLE, "fw1");
}

#[test]
fn firmware_stops_on_sigterm_after_acking_what_it_committed() {
    firmware_support::stops_on_sigterm_after_acking_what_it_committed(EXAMPLE, "fw2");
}

#[test]
fn firmware_stops_on_sigterm_mid_stream_acking_what_it_committed_and_nothing_else() {
    firmware_support::sigterm_mid_stream_acks_what_it_committed_and_nothing_else(EXAMPLE, "fw4");
}

#[test]
fn kill9_firmware_at_random_moments_loses_and_doubles_no_command() {
    firmware_support::kill9_at_random_moments_loses_and_doubles_no_command(EXAMPLE, "fw3");
}
