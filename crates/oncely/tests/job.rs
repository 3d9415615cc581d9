//! Multi-step jobs on the memory ledger: resumption, the three windows, bad
//! input, and fencing of business writes. The SQL backends run the same
//! pipeline for real in `examples/payment-job`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use oncely::backend::{Claim, Ledger, MAX_OUTCOME_BYTES, Outcome, Record, RecordState};
use oncely::{ClaimOptions, Effects, Error, Failure, MemoryLedger, OnInProgress, StepMode, Tenant};
use tokio::sync::oneshot;

fn effects() -> Effects<Arc<MemoryLedger>> {
    Effects::new(Arc::new(MemoryLedger::new()))
}

fn acme() -> Tenant {
    Tenant::new("acme").unwrap()
}

/// A record with its read time cleared, so two reads compare equal when
/// nothing changed.
fn frozen(r: Option<Record>) -> Option<Record> {
    r.map(|mut r| {
        r.read_at = UNIX_EPOCH;
        r
    })
}

async fn snapshot(effects: &Effects<Arc<MemoryLedger>>, keys: &[&str]) -> Vec<Option<Record>> {
    let mut out = Vec::new();
    for k in keys {
        out.push(frozen(
            effects
                .ledger()
                .get(&oncely::EffectKey::parse(k).unwrap())
                .await
                .unwrap(),
        ));
    }
    out
}

#[tokio::test]
async fn resumes_at_the_first_unfinished_step() {
    let fx = effects();
    let (captures, receipts) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let job = fx.job(&acme(), "payment", "order-1");
    let charge: String = job
        .step("capture", StepMode::ProviderKeyed, |ctx| {
            let captures = &captures;
            async move {
                captures.fetch_add(1, Ordering::SeqCst);
                Ok(format!("ch-{}", &ctx.provider_key()[..6]))
            }
        })
        .await
        .unwrap();
    let e = job
        .step("receipt", StepMode::AtMostOnce, |_| async {
            Err::<(), _>(Failure::retryable("smtp refused the connection"))
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Handler(_)), "{e:?}");
    let released = job.step_record("receipt", None).await.unwrap().unwrap();
    assert_eq!(released.state, RecordState::Released);

    // The redelivery: capture answers from the ledger, the receipt runs.
    let job = fx.job(&acme(), "payment", "order-1");
    let again: String = job
        .step("capture", StepMode::ProviderKeyed, |_| async {
            captures.fetch_add(1, Ordering::SeqCst);
            Ok("second charge".to_owned())
        })
        .await
        .unwrap();
    assert_eq!(again, charge);
    job.step("receipt", StepMode::AtMostOnce, |_| async {
        receipts.fetch_add(1, Ordering::SeqCst);
        Ok(())
    })
    .await
    .unwrap();
    // And one more full redelivery changes nothing.
    let job = fx.job(&acme(), "payment", "order-1");
    let _: String = job
        .step("capture", StepMode::ProviderKeyed, |_| async {
            Ok("x".to_owned())
        })
        .await
        .unwrap();
    job.step("receipt", StepMode::AtMostOnce, |_| async {
        receipts.fetch_add(1, Ordering::SeqCst);
        Ok(())
    })
    .await
    .unwrap();
    assert_eq!(captures.load(Ordering::SeqCst), 1);
    assert_eq!(receipts.load(Ordering::SeqCst), 1);
    let r = job.step_record("receipt", None).await.unwrap().unwrap();
    assert_eq!(r.key.as_str(), "acme/receipt:order-1");
    assert_eq!(r.state, RecordState::Completed);
    assert!(r.at_most_once);
    assert!(r.fence > released.fence, "the released receipt was taken over");
}

/// Runs a step in a task that "crashes" (is aborted) once the closure reaches
/// the point that `tell` marks, so nothing after that point happens.
async fn crash_inside<F>(fx: &Effects<Arc<MemoryLedger>>, kind: &'static str, mode: StepMode, effect: F)
where
    F: FnOnce(String) + Send + 'static,
{
    let (tell, reached) = oneshot::channel::<()>();
    let fx2 = fx.clone();
    let task = tokio::spawn(async move {
        let job = fx2.job(&acme(), "payment", "order-7");
        job.step(kind, mode, |ctx| async move {
            effect(ctx.provider_key());
            let _ = tell.send(());
            std::future::pending::<Result<(), Failure>>().await
        })
        .await
    });
    reached.await.expect("the closure ran");
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
}

#[tokio::test]
async fn provider_keyed_crash_reruns_after_expiry_with_the_same_key() {
    let fx = effects();
    let keys = Arc::new(Mutex::new(Vec::new()));
    let k2 = keys.clone();
    crash_inside(&fx, "capture", StepMode::ProviderKeyed, move |pk| {
        k2.lock().unwrap().push(pk)
    })
    .await;
    let job = fx
        .job(&acme(), "payment", "order-7")
        .options(ClaimOptions::default().on_in_progress(OnInProgress::Reject));
    // The lease is still live: no re-run yet.
    let e = job
        .step("capture", StepMode::ProviderKeyed, |_| async { Ok(()) })
        .await
        .unwrap_err();
    assert!(e.is_in_progress(), "{e:?}");
    let crashed = job.step_record("capture", None).await.unwrap().unwrap();
    fx.ledger().advance(Duration::from_secs(31));
    let k3 = keys.clone();
    let fence = job
        .step("capture", StepMode::ProviderKeyed, |ctx| async move {
            k3.lock().unwrap().push(ctx.provider_key());
            Ok(ctx.fence())
        })
        .await
        .unwrap();
    assert!(fence > crashed.fence, "the re-run took the expired lease over");
    let keys = keys.lock().unwrap();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1], "the re-run sends the same provider key");
}

#[tokio::test]
async fn at_most_once_crash_before_the_send_abandons_with_zero_sends() {
    let fx = effects();
    let sent = Arc::new(AtomicUsize::new(0));
    crash_inside(&fx, "receipt", StepMode::AtMostOnce, |_| {}).await;
    fx.ledger().advance(Duration::from_secs(31));
    let job = fx.job(&acme(), "payment", "order-7");
    let s = sent.clone();
    let e = job
        .step("receipt", StepMode::AtMostOnce, |_| async move {
            s.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Abandoned { .. }), "{e:?}");
    assert_eq!(sent.load(Ordering::SeqCst), 0, "never re-run automatically");
    let listed = fx.ledger().abandoned(&acme(), 10).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key.as_str(), "acme/receipt:order-7");
    assert_eq!(listed[0].state, RecordState::Abandoned);

    // Reconciliation: the mail provider says nothing went out; the operator
    // releases the step and the next delivery sends it.
    fx.ledger()
        .release(&listed[0].reconciliation_lease())
        .await
        .unwrap();
    let s = sent.clone();
    job.step("receipt", StepMode::AtMostOnce, |_| async move {
        s.fetch_add(1, Ordering::SeqCst);
        Ok(())
    })
    .await
    .unwrap();
    assert_eq!(sent.load(Ordering::SeqCst), 1);
    assert!(fx.ledger().abandoned(&acme(), 10).await.unwrap().is_empty());
}

#[tokio::test]
async fn at_most_once_crash_after_the_send_abandons_with_one_send() {
    let fx = effects();
    let sent = Arc::new(AtomicUsize::new(0));
    let s = sent.clone();
    crash_inside(&fx, "receipt", StepMode::AtMostOnce, move |_| {
        s.fetch_add(1, Ordering::SeqCst);
    })
    .await;
    fx.ledger().advance(Duration::from_secs(31));
    for _ in 0..3 {
        let s = sent.clone();
        let e = fx
            .job(&acme(), "payment", "order-7")
            .step("receipt", StepMode::AtMostOnce, |_| async move {
                s.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Abandoned { .. }), "{e:?}");
    }
    assert_eq!(sent.load(Ordering::SeqCst), 1, "sent once, never again");
    let listed = fx.ledger().abandoned(&acme(), 10).await.unwrap();
    assert_eq!(listed.len(), 1);
    // The operator learns it went out and completes it.
    fx.ledger()
        .complete(
            &listed[0].reconciliation_lease(),
            &Outcome::from_json(&serde_json::json!({"ok": null})).unwrap(),
        )
        .await
        .unwrap();
    fx.job(&acme(), "payment", "order-7")
        .step("receipt", StepMode::AtMostOnce, |_| async { Ok(()) })
        .await
        .unwrap();
    assert_eq!(sent.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_kind_reused_with_another_mode_is_misuse_and_changes_nothing() {
    let fx = effects();
    let job = fx.job(&acme(), "payment", "order-2");
    job.step("capture", StepMode::ProviderKeyed, |_| async { Ok(1) })
        .await
        .unwrap();
    let before = snapshot(&fx, &["acme/capture:order-2"]).await;
    let ran = AtomicUsize::new(0);
    let e = job
        .step("capture", StepMode::AtMostOnce, |_| async {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok(2)
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Misuse(_)), "{e:?}");
    assert!(e.is_invalid_input());
    assert!(e.to_string().contains("provider_keyed"), "{e}");
    // Also with a discriminator: one kind, one mode within a job.
    let e = job
        .step_with("capture", "retry-2", StepMode::AtMostOnce, |_| async { Ok(3) })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Misuse(_)), "{e:?}");
    // (A transactional step cannot be handed to `step` at all: see the
    // compile_fail example on `Job::step`.)
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    assert_eq!(snapshot(&fx, &["acme/capture:order-2"]).await, before);
    assert!(
        job.step_record("capture", Some("retry-2"))
            .await
            .unwrap()
            .is_none()
    );
    assert!(job.step_record("mark-paid", None).await.unwrap().is_none());
    // The same mode again is fine and answers from the ledger.
    let again: i32 = job
        .step("capture", StepMode::ProviderKeyed, |_| async { Ok(9) })
        .await
        .unwrap();
    assert_eq!(again, 1);
}

#[tokio::test]
async fn an_oversized_outcome_is_refused_and_stores_nothing() {
    let fx = effects();
    let job = fx.job(&acme(), "report", "order-3");
    let big = "x".repeat(MAX_OUTCOME_BYTES);
    let e = job
        .step("render", StepMode::ProviderKeyed, |_| async { Ok(big.clone()) })
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::OutcomeTooLarge { max, .. } if max == MAX_OUTCOME_BYTES),
        "{e:?}"
    );
    // Released, nothing stored: the next delivery runs the step again, with
    // the same provider key.
    let r = job.step_record("render", None).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Released);
    assert!(r.outcome.is_none());
    let fence: u64 = job
        .step(
            "render",
            StepMode::ProviderKeyed,
            |ctx| async move { Ok(ctx.fence()) },
        )
        .await
        .unwrap();
    assert!(fence > r.fence);

    // An at-most-once step has performed its effect: releasing would repeat
    // it, so it stays claimed and is abandoned when the lease runs out.
    let e = job
        .step("notify", StepMode::AtMostOnce, |_| async { Ok(big.clone()) })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::OutcomeTooLarge { .. }), "{e:?}");
    let r = job.step_record("notify", None).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::InProgress);
    assert!(r.outcome.is_none());
    fx.ledger().advance(Duration::from_secs(31));
    let listed = fx.ledger().abandoned(&acme(), 10).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key.as_str(), "acme/notify:order-3");
}

#[tokio::test]
async fn an_altered_payload_on_redelivery_is_a_fingerprint_mismatch() {
    let fx = effects();
    let msg = serde_json::json!({"order": "order-4", "amount": 1200});
    let job = fx
        .job(&acme(), "payment", "order-4")
        .fingerprint_of(&msg)
        .unwrap();
    job.step("capture", StepMode::ProviderKeyed, |_| async {
        Ok("ch-1".to_owned())
    })
    .await
    .unwrap();
    let before = snapshot(&fx, &["acme/capture:order-4", "acme/receipt:order-4"]).await;

    let altered = serde_json::json!({"order": "order-4", "amount": 99_999});
    let job = fx
        .job(&acme(), "payment", "order-4")
        .fingerprint_of(&altered)
        .unwrap();
    let ran = AtomicUsize::new(0);
    let e = job
        .step("capture", StepMode::ProviderKeyed, |_| async {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok("ch-2".to_owned())
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::FingerprintMismatch { .. }), "{e:?}");
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    assert_eq!(
        snapshot(&fx, &["acme/capture:order-4", "acme/receipt:order-4"]).await,
        before
    );

    // The same payload, fields in another order, is the same request.
    let same: serde_json::Value = serde_json::from_str(r#"{"amount":1200,"order":"order-4"}"#).unwrap();
    let out: String = fx
        .job(&acme(), "payment", "order-4")
        .fingerprint_of(&same)
        .unwrap()
        .step("capture", StepMode::ProviderKeyed, |_| async {
            Ok("ch-3".to_owned())
        })
        .await
        .unwrap();
    assert_eq!(out, "ch-1");
}

#[tokio::test]
async fn discriminators_key_repeated_effects_apart() {
    let fx = effects();
    let job = fx.job(&acme(), "billing", "order-5");
    let mut seen = Vec::new();
    for n in ["invoice-1", "invoice-2", "invoice-1"] {
        let k: String = job
            .step_with("invoice", n, StepMode::ProviderKeyed, |ctx| async move {
                Ok(ctx.key().to_string())
            })
            .await
            .unwrap();
        seen.push(k);
    }
    assert_eq!(
        seen,
        [
            "acme/invoice:order-5:invoice-1",
            "acme/invoice:order-5:invoice-2",
            "acme/invoice:order-5:invoice-1"
        ]
    );
    let a = job.step_key("invoice", Some("invoice-1")).unwrap();
    let b = job.step_key("invoice", Some("invoice-2")).unwrap();
    assert_ne!(a.provider_key(), b.provider_key());
    for bad in ["", " x", "x\n", "a\u{200B}b"] {
        let e = job
            .step_with("invoice", bad, StepMode::ProviderKeyed, |_| async { Ok(()) })
            .await
            .unwrap_err();
        assert!(matches!(e, Error::InvalidKey { .. }), "{bad:?}: {e:?}");
    }
    for (job_type, subject) in [("", "order-5"), ("pay/ment", "order-5"), ("payment", "")] {
        let e = fx
            .job(&acme(), job_type, subject)
            .step("capture", StepMode::ProviderKeyed, |_| async { Ok(()) })
            .await
            .unwrap_err();
        assert!(
            matches!(e, Error::InvalidKey { .. }),
            "{job_type:?}/{subject:?}: {e:?}"
        );
    }
}

#[tokio::test]
async fn terminal_failures_are_replayed_retryable_ones_released() {
    let fx = effects();
    let job = fx.job(&acme(), "payment", "order-6");
    let runs = AtomicUsize::new(0);
    for _ in 0..2 {
        let e = job
            .step("capture", StepMode::ProviderKeyed, |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(Failure::terminal("card declined"))
            })
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::Terminal { message, .. } if message == "card declined"),
            "{e:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the stored failure is replayed");
}

/// An `orders` row with a fence column, guarded the way a SQL table would be:
/// `UPDATE orders SET status = $s, fence = $f WHERE id = $id AND fence < $f`.
#[derive(Default)]
struct Orders(Mutex<HashMap<String, (String, u64)>>);

impl Orders {
    fn fenced_update(&self, id: &str, status: &str, fence: u64) -> u64 {
        let mut rows = self.0.lock().unwrap();
        let row = rows.entry(id.to_owned()).or_insert(("pending".to_owned(), 0));
        if row.1 < fence {
            *row = (status.to_owned(), fence);
            1
        } else {
            0
        }
    }
}

#[tokio::test]
async fn a_zombie_cannot_overwrite_the_new_holders_work() {
    let fx = effects();
    let orders = Arc::new(Orders::default());
    // The zombie acquires, then stalls past its lease (a long pause: its
    // renewals do not get through). It is another process: its own runner
    // on the same ledger. (A duplicate in the holder's own process waits for
    // it in memory until the lease's end on the worker's clock, which
    // `advance` does not move; past that end it goes to the ledger too.)
    let zombie_fx = Effects::new(fx.ledger().clone());
    let (stalled, resume) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let (fx2, o2, s2, r2) = (zombie_fx, orders.clone(), stalled.clone(), resume.clone());
    let zombie = tokio::spawn(async move {
        fx2.job(&acme(), "fulfil", "order-8")
            .step("ship", StepMode::ProviderKeyed, |ctx| async move {
                s2.notify_one();
                r2.notified().await;
                let rows = o2.fenced_update("order-8", "shipped-by-zombie", ctx.fence());
                Ok(rows)
            })
            .await
    });
    stalled.notified().await;
    let zombie_fence = fx
        .ledger()
        .get(&oncely::EffectKey::parse("acme/ship:order-8").unwrap())
        .await
        .unwrap()
        .unwrap()
        .fence;
    fx.ledger().advance(Duration::from_secs(31));

    // The new holder takes over with a higher fence and finishes.
    let rows: u64 = fx
        .job(&acme(), "fulfil", "order-8")
        .step("ship", StepMode::ProviderKeyed, |ctx| async move {
            assert!(ctx.fence() > zombie_fence);
            Ok(orders.fenced_update("order-8", "shipped", ctx.fence()))
        })
        .await
        .unwrap();
    assert_eq!(rows, 1);

    // The zombie wakes up: its write matches no row, its completion is refused.
    resume.notify_one();
    let e = zombie.await.unwrap().unwrap_err();
    assert!(e.is_lease_lost(), "{e:?}");
    let r = fx
        .ledger()
        .get(&oncely::EffectKey::parse("acme/ship:order-8").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r.state, RecordState::Completed);
    assert!(r.fence > zombie_fence);
    assert_eq!(r.outcome.unwrap().as_bytes(), br#"{"ok":1}"#);
}

#[tokio::test]
async fn a_slow_live_step_keeps_its_lease() {
    // Real time: the lease is renewed every third of its length while the
    // closure runs, so duplicates keep seeing it in progress. The margins are
    // wide (a renewal every ~330 ms against a 1 s lease).
    let fx = effects();
    let lease = Duration::from_secs(1);
    let opts = ClaimOptions::default()
        .lease(lease)
        .on_in_progress(OnInProgress::Reject);
    let (started_tx, started) = oneshot::channel();
    let (done_tx, mut done) = oneshot::channel::<()>();
    let fx2 = fx.clone();
    let o2 = opts.clone();
    let slow = tokio::spawn(async move {
        fx2.job(&acme(), "export", "batch-1")
            .options(o2)
            .step("upload", StepMode::ProviderKeyed, |_| async move {
                let _ = started_tx.send(());
                tokio::time::sleep(Duration::from_millis(2500)).await;
                Ok(())
            })
            .await
    });
    started.await.unwrap();
    let key = oncely::EffectKey::parse("acme/upload:batch-1").unwrap();
    let mut polls = 0;
    let mut first_fence = None;
    let watcher = async {
        loop {
            match fx.ledger().claim(&key, &opts).await.unwrap() {
                Claim::InProgress { fence, .. } => assert_eq!(*first_fence.get_or_insert(fence), fence),
                other => return other,
            }
            polls += 1;
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                _ = &mut done => unreachable!(),
            }
        }
    };
    tokio::select! {
        r = slow => { r.unwrap().unwrap(); let _ = done_tx.send(()); }
        other = watcher => panic!("a duplicate got {other:?} while the step was live"),
    }
    assert!(polls >= 3, "the watcher polled while the step ran ({polls})");
    let r = fx.ledger().get(&key).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Completed);
    assert_eq!(Some(r.fence), first_fence, "never taken over");
}

/// The one collision the old encoding had: a discriminator and a subject
/// containing `:` made the same key.
#[test]
fn step_keys_do_not_collide_across_subjects_and_discriminators() {
    let fx = effects();
    let a = fx
        .job(&acme(), "billing", "order-1")
        .step_key("invoice", Some("invoice-2"))
        .unwrap();
    let b = fx
        .job(&acme(), "billing", "order-1:invoice-2")
        .step_key("invoice", None)
        .unwrap();
    assert_ne!(a, b);
    assert_eq!(a.as_str(), "acme/invoice:order-1:invoice-2");
    assert_eq!(b.as_str(), "acme/invoice:order-1\\:invoice-2");
    // Plain subjects keep their plain form.
    let plain = fx
        .job(&acme(), "billing", "order-1")
        .step_key("capture", None)
        .unwrap();
    assert_eq!(plain.as_str(), "acme/capture:order-1");
}

proptest::proptest! {
    /// Step keys are injective: two (subject, discriminator) pairs give the
    /// same key only if they are the same pair, over subjects and
    /// discriminators made of the characters the encoding uses.
    #[test]
    fn step_keys_are_injective(
        s1 in "[a:\\\\]{1,6}", d1 in proptest::option::of("[a:\\\\]{1,6}"),
        s2 in "[a:\\\\]{1,6}", d2 in proptest::option::of("[a:\\\\]{1,6}"),
    ) {
        let fx = effects();
        let k1 = fx.job(&acme(), "j", &s1).step_key("k", d1.as_deref());
        let k2 = fx.job(&acme(), "j", &s2).step_key("k", d2.as_deref());
        if let (Ok(k1), Ok(k2)) = (k1, k2) {
            proptest::prop_assert_eq!(k1 == k2, (s1, d1) == (s2, d2));
        }
    }
}

/// An oncely error the handler passes on with `?` keeps its kind (here a
/// non-retryable invalid key) instead of becoming a retryable handler
/// failure that a consumer would redeliver forever; the key is released.
#[tokio::test]
async fn an_oncely_error_from_the_handler_keeps_its_kind() {
    let fx = effects();
    let key = oncely::EffectKey::new(&acme(), "capture", "order-err").unwrap();
    let e = fx
        .run::<u32, _, _>(&key, &ClaimOptions::default(), |_| async {
            let derived = oncely::EffectKey::new(&acme(), "cap:ture", "x")?;
            Ok(derived.as_str().len() as u32)
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidKey { .. }), "{e:?}");
    assert!(!e.is_retryable());
    let r = fx.ledger().get(&key).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Released);
}

/// `memory:` opens a fresh ledger; anything else after the colon is refused,
/// a query parameter by name.
#[tokio::test]
async fn memory_ledger_opens_from_its_url() {
    use oncely::open::{Access, FromUrl, OpenOptions};
    let opts = OpenOptions::new(Access::ReadOnly);
    assert_eq!(MemoryLedger::SCHEMES, &["memory"]);
    MemoryLedger::from_url("memory:", opts).await.unwrap();
    MemoryLedger::from_url(" MEMORY: ", opts).await.unwrap();
    for bad in ["memory:x", "memory", "sqlite:x"] {
        assert!(matches!(
            MemoryLedger::from_url(bad, opts).await,
            Err(Error::Config(_))
        ));
    }
    // A query parameter is refused as on every backend: by name.
    let e = MemoryLedger::from_url("memory:?table=x", opts).await.unwrap_err();
    assert!(
        matches!(&e, Error::Config(m) if m.contains("unknown memory URL parameter 'table' (it takes none)")),
        "{e:?}"
    );
    assert_eq!(MemoryLedger::new().to_string(), "memory (this process only)");
}
