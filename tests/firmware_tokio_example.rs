//! The tokio firmware example (one rumqttc `AsyncClient` for telemetry and commands on a current-thread
//! runtime, the inbox fed through an `AsyncFeed`, commits on the commit thread, the graceful stop from
//! tokio's signal handler) as a user runs it: the same scenarios as the sync firmware's.
#![cfg(feature = "tokio")]

mod broker;
mod common;
mod firmware_support;
mod inventory_support;
mod outbox_support;

const EXAMPLE: &str = "firmware_tokio";

#[test]
fn firmware_tokio_applies_each_command_once_and_publishes_telemetry_on_the_same_connection() {
    firmware_support::applies_each_command_once_and_publishes_telemetry(EXAMPLE, "ft1");
}

#[test]
fn firmware_tokio_stops_on_sigterm_after_acking_what_it_committed() {
    firmware_support::stops_on_sigterm_after_acking_what_it_committed(EXAMPLE, "ft2");
}

#[test]
fn firmware_tokio_stops_on_sigterm_mid_stream_acking_what_it_committed_and_nothing_else() {
    firmware_support::sigterm_mid_stream_acks_what_it_committed_and_nothing_else(EXAMPLE, "ft4");
}

#[test]
fn kill9_firmware_tokio_at_random_moments_loses_and_doubles_no_command() {
    firmware_support::kill9_at_random_moments_loses_and_doubles_no_command(EXAMPLE, "ft3");
}
