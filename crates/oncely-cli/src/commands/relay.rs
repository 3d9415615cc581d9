//! `oncely relay`: the transactional outbox's messages published to a
//! broker, until Ctrl-C (or, with `--drain`, until nothing is due).

use std::process::ExitCode;
use std::time::Duration;

use clap::Args as ClapArgs;
use oncely::outbox::{Outbox, Pass, Publisher, Relay, RelayOptions};
use oncely::{Error, Result};
use oncely_any::{Access, AnyLedger};
use oncely_relay::AnyPublisher;

use super::{DbArgs, plural, print_json};
use crate::read::Read;
use crate::time::parse_duration;

/// Publish the transactional outbox's messages to a broker.
///
/// The application enqueues a message in the same transaction as its
/// business writes (TransactionalOutbox::enqueue_in, SQL ledgers); this
/// command claims committed messages (the oldest unsent one per ordering
/// key, under a fenced lease), publishes each, waits for the broker's
/// confirmation, and only then marks it sent. Run as many relays as you
/// like: a message is held by one at a time, and a relay that stalls past
/// its lease loses it to the next. Every copy of a message carries the same
/// id, derived from its effect key. Runs until Ctrl-C; prints what it did.
///
/// Brokers (--to): amqp://USER:PASS@HOST:5672/VHOST[?exchange=NAME]
/// (RabbitMQ: the destination is the routing key, the message-id property
/// the id), nats://HOST:4222[,HOST:PORT...] (JetStream: the destination is
/// the subject, Nats-Msg-Id the id), redis://HOST:6379[/DB] (Redis Streams:
/// the destination is the stream, the message_id field the id),
/// kafka://HOST:9092[,HOST:PORT...][?PROPERTY=VALUE&...] (Kafka, an
/// idempotent producer: the destination is the topic, the ordering key the
/// record key, the oncely-message-id header the id; the query sets
/// librdkafka properties).
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The broker to publish to (see above).
    #[arg(long, env = "ONCELY_RELAY_TO", value_name = "URL")]
    to: String,
    /// Messages per pass (one per ordering key).
    #[arg(long, default_value_t = 100)]
    batch: u32,
    /// How long a claim holds its messages (e.g. 30s).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    lease: Duration,
    /// Claims after which a message the broker keeps refusing is marked
    /// failed.
    #[arg(long, default_value_t = 20)]
    max_attempts: u32,
    /// Delete sent messages older than this (e.g. 7d); 0 keeps them.
    #[arg(long, default_value = "7d", value_parser = parse_duration)]
    retention: Duration,
    /// Stop once a pass finds nothing due, instead of waiting for Ctrl-C.
    #[arg(long)]
    drain: bool,
    /// Print one JSON object with the counts.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DbArgs,
}

/// Runs the relay and prints what it did.
pub async fn run(args: Args) -> Result<ExitCode> {
    let options = RelayOptions {
        batch: args.batch,
        lease: args.lease,
        max_attempts: args.max_attempts,
        retention: (!args.retention.is_zero()).then_some(args.retention),
        ..RelayOptions::default()
    };
    options.validate()?;
    let ledger = AnyLedger::open(&args.db.database_url, Access::Existing).await?;
    let broker = AnyPublisher::connect(&args.to)
        .await
        .map_err(|e| Error::Config(format!("--to: {e}")))?;
    let to = broker.describe();
    let relay = Relay::new(ledger.clone(), broker, options)?;
    let pass = if args.drain {
        drain(&relay).await
    } else {
        // It logs a failed pass and keeps going until Ctrl-C.
        Ok(relay
            .run_until(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await)
    };
    let pending = relay.outbox().outbox_stats().await.map(|s| s.pending);
    ledger.close().await;
    let pass = pass?;
    let read = Read {
        ledger: ledger.to_string(),
        value: pass,
    };
    if args.json {
        return Ok(print_json(&read.map(|p| {
            serde_json::json!({
                "to": to,
                "claimed": p.claimed,
                "sent": p.sent,
                "fenced": p.fenced,
                "retried": p.retried,
                "failed": p.failed,
                "pruned": p.pruned,
                "pending": pending.as_ref().ok(),
            })
        })));
    }
    let p = read.value;
    println!(
        "published {} message{} from {} to {to} ({} given back to retry, {} failed, {} published again by \
         another relay, {} pruned){}",
        p.sent,
        plural(p.sent),
        read.ledger,
        p.retried,
        p.failed,
        p.fenced,
        p.pruned,
        match pending {
            Ok(n) => format!("; {n} pending"),
            Err(_) => String::new(),
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// Passes until one claims nothing; the sum of what they did. A pass that
/// fails (the database unreachable) ends it with that error.
async fn drain(relay: &Relay<AnyLedger, AnyPublisher>) -> Result<Pass> {
    let mut total = Pass::default();
    loop {
        let pass = relay.pass().await?;
        if pass.claimed == 0 {
            return Ok(total);
        }
        total.add(pass);
        if pass.retried > 0 {
            // What the broker refused is due again after its back-off.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
