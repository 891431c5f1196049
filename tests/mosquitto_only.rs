//! Tests that need mosquitto itself, not just a broker: a restart with persistence, its packet log, TLS with
//! password files, ACLs, the `mosquitto_pub` client. Without mosquitto they are reported ignored, with the
//! reason, decided when the tests run (see `broker::run_mosquitto_only`); everything else runs on any broker.

mod broker;
mod common;
mod inventory_support;
mod outbox_support;

#[path = "mosquitto_only/consumer.rs"]
mod consumer;
#[path = "mosquitto_only/inventory.rs"]
mod inventory;
#[path = "mosquitto_only/relay.rs"]
mod relay;
#[path = "mosquitto_only/tls.rs"]
mod tls;

fn main() {
    broker::run_mosquitto_only(&[
        (
            "consumer::mosquitto_pub_v5_duplicates_conflicts_and_missing_ids_are_counted_and_acked",
            consumer::mosquitto_pub_v5_duplicates_conflicts_and_missing_ids_are_counted_and_acked,
        ),
        (
            "consumer::broker_restart_mid_stream_loses_and_doubles_nothing",
            consumer::broker_restart_mid_stream_loses_and_doubles_nothing,
        ),
        (
            "consumer::acks_leave_in_arrival_order_as_seen_by_the_broker",
            consumer::acks_leave_in_arrival_order_as_seen_by_the_broker,
        ),
        (
            "consumer::storage_errors_ack_nothing_and_the_batch_is_retried_until_it_commits",
            consumer::storage_errors_ack_nothing_and_the_batch_is_retried_until_it_commits,
        ),
        (
            "consumer::a_subscription_granted_only_at_qos0_ends_the_run_with_an_error",
            consumer::a_subscription_granted_only_at_qos0_ends_the_run_with_an_error,
        ),
        (
            "consumer::a_refusal_after_a_grant_reconnects_until_the_broker_grants_again",
            consumer::a_refusal_after_a_grant_reconnects_until_the_broker_grants_again,
        ),
        (
            "relay::rows_wait_while_the_broker_is_away_and_drain_in_order_when_it_returns",
            relay::rows_wait_while_the_broker_is_away_and_drain_in_order_when_it_returns,
        ),
        (
            "relay::a_message_the_broker_keeps_refusing_is_parked_and_the_rest_go_on",
            relay::a_message_the_broker_keeps_refusing_is_parked_and_the_rest_go_on,
        ),
        (
            "tls::tls_with_password_consumes_and_a_wrong_password_never_connects",
            tls::tls_with_password_consumes_and_a_wrong_password_never_connects,
        ),
        (
            "inventory::tls_and_a_password_from_a_file_or_the_environment_connect_and_the_password_is_never_logged",
            inventory::tls_and_a_password_from_a_file_or_the_environment_connect_and_the_password_is_never_logged,
        ),
        (
            "inventory::an_idle_run_that_never_reaches_the_broker_fails_and_the_next_confirms_every_announcement",
            inventory::an_idle_run_that_never_reaches_the_broker_fails_and_the_next_confirms_every_announcement,
        ),
    ])
}
