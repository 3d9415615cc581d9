//! ```text
//! outbox-payments [POSTGRES_URL]   # default postgres://postgres@127.0.0.1:5432/test
//! ```
//! `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`) names the
//! broker.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let amqp = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let pg = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".into());
    let s = outbox_payments::run(outbox_payments::ledger(&pg).await?, &amqp, 100).await?;
    println!(
        "{} orders (each published twice, plus 1 poison): {} captured once, {} marked paid; \
         order.paid: {} enqueued, {} published, {} delivered; receipts: {} sent, {} duplicates",
        s.orders,
        s.captured_once,
        s.marked_paid,
        s.events_enqueued,
        s.events_published,
        s.events_delivered,
        s.receipts_sent,
        s.duplicate_receipts
    );
    anyhow::ensure!(
        s.captured_once == s.orders && s.receipts_sent == s.orders as u64 && s.duplicate_receipts == 0,
        "an order was not captured, or a receipt not sent, exactly once"
    );
    Ok(())
}
