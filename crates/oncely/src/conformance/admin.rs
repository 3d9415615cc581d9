//! The admin cases: the [`Admin`] capability (listing, paging, stats, forget),
//! run by backends that offer it through
//! [`admin_conformance_tests!`](crate::conformance::admin_conformance_tests).

use std::collections::HashSet;
use std::time::Duration;

use super::{SHORT_LEASE, SHORT_LEASE_WAIT, acquired, fresh_tenant, key, opts};
use crate::admin::{Admin, Cursor, Filter, MAX_PAGE, RecordQuery};
use crate::record::{Claim, Outcome, Record, RecordState};
use crate::{EffectKey, Error};

/// Pages through `query` with `page` records a time; panics after 10,000
/// pages (a cursor that does not advance).
async fn page_all<L: Admin>(ledger: &L, query: RecordQuery, page: u32) -> Vec<Record> {
    let mut all = Vec::new();
    let mut cursor: Option<Cursor> = None;
    for _ in 0..10_000 {
        let got = ledger
            .records(&query.clone().after(cursor.clone()).limit(page))
            .await
            .unwrap();
        assert!(
            got.len() <= page as usize,
            "a page of {page} returned {}",
            got.len()
        );
        let Some(last) = got.last() else {
            return all;
        };
        cursor = Some(Cursor::after(last));
        let short = got.len() < page as usize;
        all.extend(got);
        if short {
            return all;
        }
    }
    panic!("paging never ended");
}

fn in_listing_order(records: &[Record]) {
    for w in records.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        assert!(
            (a.created_at, a.key.as_str().as_bytes()) < (b.created_at, b.key.as_str().as_bytes()),
            "listing order: {} ({:?}) before {} ({:?})",
            a.key,
            a.created_at,
            b.key,
            b.created_at
        );
    }
}

async fn completed<L: Admin>(ledger: &L, k: &EffectKey, value: &str) -> u64 {
    let l = acquired(ledger.claim(k, &opts()).await.unwrap());
    ledger
        .complete(&l, &Outcome::from_json(&value).unwrap())
        .await
        .unwrap();
    l.fence()
}

/// Paging a tenant's records with a cursor lists each exactly once, oldest
/// first (`created_at`, then key bytes), whatever the page size; the same
/// holds across all tenants (other tests write meanwhile), and `since`,
/// `kind` and `subject` narrow the listing.
pub async fn admin_pages_cover_each_record_once<L: Admin>(ledger: L) {
    let t = fresh_tenant();
    let mut keys = HashSet::new();
    for i in 0..23 {
        let kind = if i % 3 == 0 { "receipt" } else { "capture" };
        let k = key(&t, kind, &format!("order-{i:02}"));
        let l = acquired(ledger.claim(&k, &opts()).await.unwrap());
        if i % 2 == 0 {
            ledger
                .complete(&l, &Outcome::from_json(&i).unwrap())
                .await
                .unwrap();
        }
        keys.insert(k.as_str().to_owned());
    }
    for page in [1, 5, 7, 23, 100] {
        let all = page_all(&ledger, RecordQuery::tenant(&t), page).await;
        in_listing_order(&all);
        let listed: Vec<&str> = all.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(listed.len(), 23, "page size {page}: {listed:?}");
        assert_eq!(
            listed.iter().map(|s| s.to_string()).collect::<HashSet<_>>(),
            keys,
            "page size {page}"
        );
    }
    // Across tenants: ours appear once each, among everyone else's.
    let all = page_all(&ledger, RecordQuery::tenant(&t), 100).await;
    let first = all[0].created_at;
    let across = page_all(&ledger, RecordQuery::all_tenants().since(first), 50).await;
    in_listing_order(&across);
    let ours: Vec<&Record> = across.iter().filter(|r| r.key.tenant() == &t).collect();
    assert_eq!(ours.len(), 23);
    assert_eq!(
        ours.iter().map(|r| r.key.as_str()).collect::<HashSet<_>>().len(),
        23
    );
    // Filters narrow.
    let receipts = page_all(&ledger, RecordQuery::tenant(&t).kind("receipt"), 4).await;
    assert_eq!(receipts.len(), 8);
    assert!(receipts.iter().all(|r| r.key.kind() == "receipt"));
    let one = ledger
        .records(&RecordQuery::tenant(&t).kind("capture").subject("order-05"))
        .await
        .unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].key.as_str(), key(&t, "capture", "order-05").as_str());
    let late = all[10].created_at;
    let since = page_all(&ledger, RecordQuery::tenant(&t).since(late), 100).await;
    // (Records created in the same clock tick as the 11th are in too.)
    assert!(since.len() >= 13, "{}", since.len());
    assert!(since.iter().all(|r| r.created_at >= late));
    assert_eq!(since.len(), all.iter().filter(|r| r.created_at >= late).count());
    // A page is bounded.
    let capped = ledger
        .records(&RecordQuery::tenant(&t).limit(MAX_PAGE + 1_000))
        .await
        .unwrap();
    assert_eq!(capped.len(), 23);
    assert_eq!(RecordQuery::default().limit(5_000).page_size(), MAX_PAGE);
    assert_eq!(RecordQuery::default().limit(0).page_size(), MAX_PAGE);
}

/// One tenant's listing, stats and forget never see or touch another's
/// records with the same kind and subject.
pub async fn admin_tenants_are_isolated<L: Admin>(ledger: L) {
    let (a, b) = (fresh_tenant(), fresh_tenant());
    let (ka, kb) = (key(&a, "capture", "order-1"), key(&b, "capture", "order-1"));
    let fa = completed(&ledger, &ka, "a").await;
    let fb = completed(&ledger, &kb, "b").await;
    let listed = ledger.records(&RecordQuery::tenant(&a)).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, ka);
    let stats = ledger.stats(Some(&a)).await.unwrap();
    assert_eq!(stats.len(), 1, "{stats:?}");
    assert_eq!(stats[0].tenant, a);
    assert_eq!(stats[0].completed, 1);
    // Forgetting A's key at B's fence (or A's) leaves B's record alone.
    if fa != fb {
        assert!(ledger.forget(&ka, fb).await.unwrap_err().is_lease_lost());
    }
    ledger.forget(&ka, fa).await.unwrap();
    let rb = ledger.get(&kb).await.unwrap().unwrap();
    assert_eq!(rb.state, RecordState::Completed);
    assert_eq!(rb.outcome.unwrap().to_value::<String>().unwrap(), "b");
    let stats_b = ledger.stats(Some(&b)).await.unwrap();
    assert_eq!((stats_b[0].completed, stats_b[0].released), (1, 0));
    // Across tenants, both appear.
    let all = ledger.stats(None).await.unwrap();
    assert!(all.iter().any(|s| s.tenant == a && s.released == 1));
    assert!(all.iter().any(|s| s.tenant == b && s.completed == 1));
}

/// Live, stuck, abandoned, completed and released records are told apart on
/// the backend's clock: by the filters, and in the stats with the oldest
/// `created_at` of each open class.
pub async fn admin_classifies_on_the_backend_clock<L: Admin>(ledger: L) {
    let t = fresh_tenant();
    let short = opts().lease(SHORT_LEASE);
    let stuck = key(&t, "capture", "stuck");
    let abandoned = key(&t, "capture", "abandoned");
    acquired(ledger.claim(&stuck, &short).await.unwrap());
    acquired(
        ledger
            .claim(&abandoned, &short.clone().at_most_once(true))
            .await
            .unwrap(),
    );
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    let live = key(&t, "capture", "live");
    let done = key(&t, "capture", "done");
    let released = key(&t, "capture", "released");
    acquired(ledger.claim(&live, &opts()).await.unwrap());
    completed(&ledger, &done, "ok").await;
    let l = acquired(ledger.claim(&released, &opts()).await.unwrap());
    ledger.release(&l).await.unwrap();

    let only = |f: Filter| {
        let ledger = &ledger;
        let t = t.clone();
        async move {
            let mut ks: Vec<String> = ledger
                .records(&RecordQuery::tenant(&t).filter(f))
                .await
                .unwrap()
                .into_iter()
                .map(|r| r.key.subject().to_owned())
                .collect();
            ks.sort();
            ks
        }
    };
    assert_eq!(only(Filter::Live).await, ["live"]);
    assert_eq!(only(Filter::Stuck).await, ["stuck"]);
    assert_eq!(only(Filter::Abandoned).await, ["abandoned"]);
    assert_eq!(only(Filter::State(RecordState::Abandoned)).await, ["abandoned"]);
    assert_eq!(only(Filter::State(RecordState::Completed)).await, ["done"]);
    assert_eq!(only(Filter::State(RecordState::Released)).await, ["released"]);
    assert_eq!(
        only(Filter::State(RecordState::InProgress)).await,
        ["live", "stuck"]
    );
    assert_eq!(only(Filter::Any).await.len(), 5);
    // The abandoned one reads as abandoned, the stuck one as in progress.
    let listed = ledger.records(&RecordQuery::tenant(&t)).await.unwrap();
    let state = |s: &str| listed.iter().find(|r| r.key.subject() == s).unwrap().state;
    assert_eq!(state("abandoned"), RecordState::Abandoned);
    assert_eq!(state("stuck"), RecordState::InProgress);

    let stats = ledger.stats(Some(&t)).await.unwrap();
    assert_eq!(stats.len(), 1, "{stats:?}");
    let s = &stats[0];
    assert_eq!((s.tenant.clone(), s.kind.as_str()), (t.clone(), "capture"));
    assert_eq!(
        (s.live, s.stuck, s.abandoned, s.completed, s.released),
        (1, 1, 1, 1, 1),
        "{s:?}"
    );
    assert_eq!(s.total(), 5);
    let created = |k: &EffectKey| listed.iter().find(|r| &r.key == k).unwrap().created_at;
    assert_eq!(s.oldest_live, Some(created(&live)));
    assert_eq!(s.oldest_stuck, Some(created(&stuck)));
    assert_eq!(s.oldest_abandoned, Some(created(&abandoned)));
    assert!(s.read_at >= created(&released));

    // Taking the stuck lease over makes it live again.
    let taken = acquired(ledger.claim(&stuck, &opts()).await.unwrap());
    assert!(taken.taken_over());
    assert_eq!(only(Filter::Stuck).await, Vec::<String>::new());
    assert_eq!(only(Filter::Live).await, ["live", "stuck"]);
}

/// Stats count per tenant and kind, ordered by kind.
pub async fn admin_stats_count_per_kind<L: Admin>(ledger: L) {
    let t = fresh_tenant();
    for i in 0..3 {
        completed(&ledger, &key(&t, "capture", &format!("o-{i}")), "ok").await;
    }
    for i in 0..2 {
        acquired(
            ledger
                .claim(&key(&t, "receipt", &format!("o-{i}")), &opts())
                .await
                .unwrap(),
        );
    }
    let stats = ledger.stats(Some(&t)).await.unwrap();
    let kinds: Vec<&str> = stats.iter().map(|s| s.kind.as_str()).collect();
    assert_eq!(kinds, ["capture", "receipt"]);
    assert_eq!((stats[0].completed, stats[0].live, stats[0].total()), (3, 0, 3));
    assert_eq!(stats[0].oldest_live, None);
    assert_eq!((stats[1].completed, stats[1].live, stats[1].total()), (0, 2, 2));
    assert!(stats[1].oldest_live.is_some());
    assert!(ledger.stats(Some(&fresh_tenant())).await.unwrap().is_empty());
}

/// Forget turns a completed record at exactly that fence into a released
/// one without its outcome; the next claim takes it over with a higher
/// fence, and the earlier lease stays refused.
pub async fn forget_then_claim_takes_over<L: Admin>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "order-9");
    let l1 = acquired(ledger.claim(&k, &opts()).await.unwrap());
    ledger
        .complete(&l1, &Outcome::from_json(&"first").unwrap())
        .await
        .unwrap();
    let before = ledger.get(&k).await.unwrap().unwrap();
    ledger.forget(&k, l1.fence()).await.unwrap();
    let r = ledger.get(&k).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Released);
    assert_eq!(r.fence, l1.fence(), "forget keeps the fence");
    assert!(r.outcome.is_none());
    assert_eq!(r.created_at, before.created_at);
    assert!(r.retain_until > r.read_at, "kept for its retention");
    // Forgetting again: it is no longer completed.
    let e = ledger.forget(&k, l1.fence()).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::NotCompleted {
                state: RecordState::Released,
                ..
            }
        ),
        "{e:?}"
    );
    let l2 = acquired(ledger.claim(&k, &opts()).await.unwrap());
    assert!(l2.fence() > l1.fence());
    assert!(l2.taken_over());
    assert!(
        ledger
            .complete(&l1, &Outcome::from_json(&"zombie").unwrap())
            .await
            .unwrap_err()
            .is_lease_lost()
    );
    ledger
        .complete(&l2, &Outcome::from_json(&"second").unwrap())
        .await
        .unwrap();
    match ledger.claim(&k, &opts()).await.unwrap() {
        Claim::Completed(r) => {
            assert_eq!(r.outcome.unwrap().to_value::<String>().unwrap(), "second");
            assert_eq!(r.fence, l2.fence());
        }
        other => panic!("expected Completed, got {other:?}"),
    }
}

/// Forget changes nothing and says why on an absent key, a live lease, a
/// fence that moved, a stuck lease and an abandoned step.
pub async fn forget_is_refused_unless_completed_at_the_fence<L: Admin>(ledger: L) {
    let t = fresh_tenant();
    let absent = key(&t, "capture", "absent");
    let e = ledger.forget(&absent, 1).await.unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
    assert!(ledger.get(&absent).await.unwrap().is_none(), "nothing created");

    let live = key(&t, "capture", "live");
    let l = acquired(ledger.claim(&live, &opts()).await.unwrap());
    let e = ledger.forget(&live, l.fence()).await.unwrap_err();
    assert!(
        matches!(e, Error::InProgress { fence, .. } if fence == l.fence()),
        "{e:?}"
    );
    let r = ledger.get(&live).await.unwrap().unwrap();
    assert_eq!((r.state, r.fence), (RecordState::InProgress, l.fence()));
    ledger
        .complete(&l, &Outcome::from_json(&"kept").unwrap())
        .await
        .unwrap();

    // The fence moved (or never was this one): refused, the outcome stays.
    for wrong in [l.fence() - 1, l.fence() + 1] {
        let e = ledger.forget(&live, wrong).await.unwrap_err();
        assert!(
            matches!(e, Error::LeaseLost { fence, .. } if fence == wrong),
            "{e:?}"
        );
    }
    let r = ledger.get(&live).await.unwrap().unwrap();
    assert_eq!(r.state, RecordState::Completed);
    assert_eq!(r.outcome.unwrap().to_value::<String>().unwrap(), "kept");

    let short = opts().lease(SHORT_LEASE);
    let stuck = key(&t, "capture", "stuck");
    let ls = acquired(ledger.claim(&stuck, &short).await.unwrap());
    let abandoned = key(&t, "receipt", "abandoned");
    let la = acquired(
        ledger
            .claim(&abandoned, &short.clone().at_most_once(true))
            .await
            .unwrap(),
    );
    tokio::time::sleep(SHORT_LEASE_WAIT).await;
    let e = ledger.forget(&stuck, ls.fence()).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::NotCompleted {
                state: RecordState::InProgress,
                ..
            }
        ),
        "{e:?}"
    );
    let e = ledger.forget(&abandoned, la.fence()).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::NotCompleted {
                state: RecordState::Abandoned,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        ledger.get(&abandoned).await.unwrap().unwrap().state,
        RecordState::Abandoned
    );
    assert_eq!(ledger.get(&stuck).await.unwrap().unwrap().fence, ls.fence());
}

/// `prunable` counts a record past its retention and deletes nothing.
pub async fn prunable_counts_without_deleting<L: Admin>(ledger: L) {
    let k = key(&fresh_tenant(), "capture", "old");
    let short = opts()
        .lease(Duration::from_millis(50))
        .retention(Duration::from_millis(50));
    let l = acquired(ledger.claim(&k, &short).await.unwrap());
    ledger
        .complete(&l, &Outcome::from_json(&1).unwrap())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let n = ledger.prunable().await.unwrap();
    // Other tests may prune the same table meanwhile; unless one did, the
    // record is counted and still there.
    if ledger.get(&k).await.unwrap().is_some() {
        assert!(n >= 1, "a record past its retention is prunable");
        assert!(ledger.prunable().await.unwrap() >= 1, "a dry run deletes nothing");
    }
}

/// Erase by subject removes the outcome and fingerprint of the subject's
/// completed and released records, and of nothing else (another subject,
/// one that only starts like it, another tenant); keeps key, state, fence,
/// `created_at` and retention; a duplicate of the erased completed effect
/// fails with [`Error::Erased`] whatever fingerprint it brings, and the
/// runner never runs its handler; a released one is taken over at a higher
/// fence; a record in progress is left pending until its holder settles;
/// fences keep growing across a later forget.
pub async fn erase_keeps_the_effect_done<L: Admin + 'static>(ledger: L) {
    let ledger = std::sync::Arc::new(ledger);
    let (t, other_tenant) = (fresh_tenant(), fresh_tenant());
    let subject = "person-7";
    let fp = crate::record::Fingerprint::of_bytes(b"card 4242");
    let with_fp = opts().fingerprint(fp);
    let secret = "secret-outcome-of-person-7";
    let capture = key(&t, "capture", subject);
    let receipt = key(&t, "receipt", subject);
    let refund = key(&t, "refund", subject);
    let email = key(&t, "email", subject);
    let kept = [
        key(&t, "capture", "person-70"),
        key(&t, "capture", "Person-7"),
        key(&t, "capture", "person-7:invoice-1"),
        key(&other_tenant, "capture", subject),
    ];
    let l = acquired(ledger.claim(&capture, &with_fp).await.unwrap());
    ledger
        .complete(&l, &Outcome::value(&secret).unwrap())
        .await
        .unwrap();
    let before = ledger.get(&capture).await.unwrap().unwrap();
    completed(&ledger, &receipt, secret).await;
    let lr = acquired(ledger.claim(&refund, &with_fp).await.unwrap());
    ledger.release(&lr).await.unwrap();
    let live = acquired(ledger.claim(&email, &opts()).await.unwrap());
    for k in &kept {
        let l = acquired(ledger.claim(k, &with_fp).await.unwrap());
        ledger
            .complete(&l, &Outcome::value(&secret).unwrap())
            .await
            .unwrap();
    }

    // A dry run lists what erase does and writes nothing.
    let dry = ledger.erase_dry_run(&t, subject).await.unwrap();
    let r = ledger.get(&capture).await.unwrap().unwrap();
    assert_eq!(
        (&r.outcome, r.fingerprint, r.fence, r.updated_at),
        (
            &before.outcome,
            before.fingerprint,
            before.fence,
            before.updated_at
        ),
        "a dry run leaves the outcome and the fingerprint"
    );
    assert!(matches!(
        ledger.claim(&capture, &with_fp).await.unwrap(),
        Claim::Completed(r) if r.outcome == before.outcome
    ));

    let erasure = ledger.erase(&t, subject).await.unwrap();
    let mut erased = vec![capture.clone(), receipt.clone(), refund.clone()];
    erased.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    assert_eq!(erasure.erased, erased);
    assert_eq!(erasure.pending, vec![email.clone()]);
    assert!(!erasure.is_complete());
    assert_eq!((&dry.erased, &dry.pending), (&erasure.erased, &erasure.pending));

    let r = ledger.get(&capture).await.unwrap().unwrap();
    assert!(r.is_erased(), "{r:?}");
    assert_eq!(r.state, RecordState::Completed);
    assert_eq!((r.outcome.as_ref(), r.fingerprint), (None, None));
    assert_eq!(r.fence, before.fence, "erase keeps the fence");
    assert_eq!(
        r.created_at, before.created_at,
        "erase keeps the horizon's instant"
    );
    assert_eq!(r.retain_until, before.retain_until, "erase keeps the retention");
    let r = ledger.get(&refund).await.unwrap().unwrap();
    assert_eq!((r.state, r.fingerprint), (RecordState::Released, None));
    for k in &kept {
        let r = ledger.get(k).await.unwrap().unwrap();
        assert_eq!(r.fingerprint, Some(fp), "{k} is not the subject's");
        assert_eq!(
            r.stored::<String>().unwrap().unwrap(),
            crate::record::StoredOutcome::Value(secret.to_owned())
        );
    }

    // A duplicate of the erased completed effect: refused, never re-run.
    for o in [
        opts(),
        with_fp.clone(),
        opts().fingerprint(crate::record::Fingerprint::of_bytes(b"x")),
    ] {
        let e = ledger.claim(&capture, &o).await.unwrap_err();
        assert!(
            matches!(e, Error::Erased { ref key } if *key == capture.to_string()),
            "{e:?}"
        );
        assert!(!e.is_retryable());
    }
    let runs = std::sync::atomic::AtomicU32::new(0);
    let effects = crate::Effects::new(ledger.clone());
    let e = effects
        .run(&receipt, &opts(), async |_| {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, crate::Failure>("again".to_owned())
        })
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Erased { .. }), "{e:?}");
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the handler never runs"
    );
    assert_eq!(ledger.get(&capture).await.unwrap().unwrap().fence, before.fence);

    // Released: the next claim takes it over, above the erased fence.
    let l2 = acquired(ledger.claim(&refund, &with_fp).await.unwrap());
    assert!(l2.fence() > lr.fence() && l2.taken_over());
    ledger.release(&l2).await.unwrap();

    // The live holder settles; then the subject erases whole.
    ledger
        .complete(&live, &Outcome::value(&secret).unwrap())
        .await
        .unwrap();
    let again = ledger.erase(&t, subject).await.unwrap();
    assert!(again.is_complete(), "{again:?}");
    assert!(again.erased.contains(&email) && again.erased.contains(&capture));
    assert!(ledger.get(&email).await.unwrap().unwrap().is_erased());
    // Nothing of another tenant's subject, nor of one that starts alike.
    assert!(
        ledger
            .erase(&fresh_tenant(), subject)
            .await
            .unwrap()
            .erased
            .is_empty()
    );

    // Fences keep growing: an operator forgets the erased effect on purpose;
    // its next run is fenced above every earlier one.
    ledger.forget(&capture, before.fence).await.unwrap();
    let l3 = acquired(ledger.claim(&capture, &with_fp).await.unwrap());
    assert!(l3.fence() > before.fence && l3.taken_over());
}

/// Erase refuses a subject a key could not hold, before any round trip,
/// changing nothing.
pub async fn erase_refuses_a_bad_subject<L: Admin>(ledger: L) {
    let t = fresh_tenant();
    for bad in ["", " person-7", "person-7 ", "a\u{200b}b", &"x".repeat(300)] {
        let e = ledger.erase(&t, bad).await.unwrap_err();
        assert!(matches!(e, Error::InvalidKey { .. }), "{bad:?}: {e:?}");
    }
}

/// `replace_outcome` writes only a completed record at exactly that fence
/// that still holds the expected outcome; otherwise it changes nothing.
pub async fn replace_outcome_is_conditional<L: Admin>(ledger: L) {
    let t = fresh_tenant();
    let k = key(&t, "capture", "order-1");
    let (a, b, c) = (
        Outcome::value(&"a").unwrap(),
        Outcome::value(&"b").unwrap(),
        Outcome::value(&"c").unwrap(),
    );
    let absent = key(&t, "capture", "absent");
    assert!(!ledger.replace_outcome(&absent, 1, &a, &b).await.unwrap());
    assert!(ledger.get(&absent).await.unwrap().is_none(), "nothing created");
    let l = acquired(ledger.claim(&k, &opts()).await.unwrap());
    assert!(
        !ledger.replace_outcome(&k, l.fence(), &a, &b).await.unwrap(),
        "in progress"
    );
    ledger.complete(&l, &a).await.unwrap();
    assert!(
        !ledger.replace_outcome(&k, l.fence() + 1, &a, &b).await.unwrap(),
        "another fence"
    );
    assert!(ledger.replace_outcome(&k, l.fence(), &a, &b).await.unwrap());
    assert!(
        !ledger.replace_outcome(&k, l.fence(), &a, &c).await.unwrap(),
        "no longer holds a"
    );
    match ledger.claim(&k, &opts()).await.unwrap() {
        Claim::Completed(r) => assert_eq!((r.outcome, r.fence), (Some(b.clone()), l.fence())),
        other => panic!("expected Completed, got {other:?}"),
    }
    ledger.erase(&t, "order-1").await.unwrap();
    assert!(
        !ledger.replace_outcome(&k, l.fence(), &b, &c).await.unwrap(),
        "erased"
    );
    assert!(ledger.get(&k).await.unwrap().unwrap().is_erased());
}

/// An erasure racing claims that take the subject's released records over
/// lists each record it found exactly once, erased or pending, never
/// neither: a record a claim took over while the erasure waited on it is
/// pending (its new holder may store an outcome), not silently skipped.
pub async fn erase_lists_every_record_once_under_concurrent_claims<L: Admin + 'static>(ledger: L) {
    let ledger = std::sync::Arc::new(ledger);
    let t = fresh_tenant();
    let subject = "person-8";
    let keys: Vec<EffectKey> = (0..40).map(|i| key(&t, &format!("step{i}"), subject)).collect();
    for k in &keys {
        let l = acquired(ledger.claim(k, &opts()).await.unwrap());
        ledger.release(&l).await.unwrap();
    }
    let claims: Vec<_> = keys
        .iter()
        .cloned()
        .map(|k| {
            let ledger = ledger.clone();
            tokio::spawn(async move { ledger.claim(&k, &opts()).await.map(|c| c.label()) })
        })
        .collect();
    let erasure = ledger.erase(&t, subject).await.unwrap();
    for c in claims {
        c.await.unwrap().unwrap();
    }
    let mut listed: Vec<&EffectKey> = erasure.erased.iter().chain(&erasure.pending).collect();
    listed.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    let mut all: Vec<&EffectKey> = keys.iter().collect();
    all.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    assert_eq!(listed, all, "each record once, erased or pending: {erasure:?}");
    for k in &erasure.erased {
        let r = ledger.get(k).await.unwrap().unwrap();
        // Erased while released; a claim after the erasure may have taken
        // it over since, with a fingerprint of its own (none here).
        assert_eq!(r.fingerprint, None, "{k}");
    }
}

/// [`erase_lists_every_record_once_under_concurrent_claims`] across nodes
/// (one ledger per node of one replicated database: a Galera cluster's,
/// whose row locks do not reach another node): the erasure runs on the
/// first node while claims on the others take the subject's released
/// records over, so one of each pair fails certification at commit and
/// must run again. Each record is still listed once, erased or pending;
/// and every node then answers the subject's completed effects with
/// [`Error::Erased`], their outcome gone.
pub async fn erase_across_nodes_lists_every_record_once<L: Admin + 'static>(nodes: Vec<L>) {
    assert!(nodes.len() >= 2, "two nodes at least");
    let nodes: Vec<std::sync::Arc<L>> = nodes.into_iter().map(std::sync::Arc::new).collect();
    let t = fresh_tenant();
    let subject = "person-9";
    let released: Vec<EffectKey> = (0..30).map(|i| key(&t, &format!("step{i}"), subject)).collect();
    let completed: Vec<EffectKey> = (0..10).map(|i| key(&t, &format!("done{i}"), subject)).collect();
    for k in &released {
        let l = acquired(nodes[0].claim(k, &opts()).await.unwrap());
        nodes[0].release(&l).await.unwrap();
    }
    for k in &completed {
        let l = acquired(nodes[0].claim(k, &opts()).await.unwrap());
        nodes[0]
            .complete(&l, &Outcome::from_json(&"alice@example.com").unwrap())
            .await
            .unwrap();
    }
    let claims: Vec<_> = released
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, k)| {
            let node = nodes[1 + i % (nodes.len() - 1)].clone();
            tokio::spawn(async move { node.claim(&k, &opts()).await.map(|c| c.label()) })
        })
        .collect();
    let erasure = nodes[0].erase(&t, subject).await.unwrap();
    for c in claims {
        c.await.unwrap().unwrap();
    }
    let mut listed: Vec<&EffectKey> = erasure.erased.iter().chain(&erasure.pending).collect();
    listed.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    let mut all: Vec<&EffectKey> = released.iter().chain(&completed).collect();
    all.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    assert_eq!(listed, all, "each record once, erased or pending: {erasure:?}");
    for k in &completed {
        assert!(erasure.erased.contains(k), "{k} is completed: erased");
        for node in &nodes {
            let e = node.claim(k, &opts()).await.unwrap_err();
            assert!(matches!(e, Error::Erased { .. }), "{k}: {e:?}");
            assert!(node.get(k).await.unwrap().unwrap().is_erased(), "{k}");
        }
    }
}
