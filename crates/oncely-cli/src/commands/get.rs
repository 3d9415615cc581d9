//! `oncely get`: one effect's record as JSON.

use std::process::ExitCode;

use clap::Args as ClapArgs;
use oncely::backend::{Ledger, Record};
use oncely::codec::{Envelope, Keyring, OutcomeCodec};
use oncely::{EffectKey, Result};
use oncely_any::Access;
use serde::Serialize;

use super::{DbArgs, SubjectKeyArgs, no_record, print_json};
use crate::read::{Read, with_ledger};
use crate::view::RecordView;

/// Print one effect's record as JSON.
///
/// The key is the displayed form tenant/kind:subject, e.g.
/// acme/capture:order-123. Exits 3 (and prints null) when the key has
/// no record. Opens the ledger read-only: it creates, migrates and
/// writes nothing (a missing database or table is an error), so a role
/// that may only SELECT can run it. With --subject-key-file, the key's
/// subject is the raw identifier (acme/receipt:alice@example.com) and
/// the record of its keyed hash is read.
///
/// An encrypted outcome shows as {"encrypted": {"key_id", "bytes",
/// "compressed"}};
/// with --decrypt it is opened with the outcome keyring (--keys-file,
/// ONCELY_OUTCOME_KEYS_FILE or ONCELY_OUTCOME_KEYS, as for reencrypt) and
/// shown in clear, with the key id in "decrypted_with".
#[derive(Debug, ClapArgs)]
pub struct Args {
    /// The effect key, tenant/kind:subject.
    key: String,
    /// Open an encrypted outcome with the outcome keyring.
    #[arg(long)]
    decrypt: bool,
    /// The keyring file, for --decrypt (ignored without it).
    #[arg(long, env = "ONCELY_OUTCOME_KEYS_FILE", value_name = "PATH")]
    keys_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    subject_key: SubjectKeyArgs,
    #[command(flatten)]
    db: DbArgs,
}

/// Prints the record, or `null` and "no record" (exit 3).
pub async fn run(args: Args) -> Result<ExitCode> {
    let keys = if args.decrypt {
        Some(super::reencrypt::load_keys(args.keys_file.as_deref())?)
    } else {
        None
    };
    let key = match args.subject_key.key()? {
        Some(secret) => {
            let raw = EffectKey::parse(&args.key)?;
            EffectKey::hashed(raw.tenant(), raw.kind(), raw.subject(), &secret)?.to_string()
        }
        None => args.key.clone(),
    };
    let read = get(&args.db.database_url, &key).await?;
    Ok(match read.value {
        Some(record) => {
            let (record, decrypted_with) = match &keys {
                Some(keys) => decrypt(keys, record)?,
                None => (record, None),
            };
            print_json(&Read {
                ledger: read.ledger,
                value: Shown {
                    record: RecordView::from(&record),
                    decrypted_with,
                },
            })
        }
        None => {
            println!("null");
            no_record(&key, &read.ledger)
        }
    })
}

/// The record as `get` prints it.
#[derive(Serialize)]
struct Shown {
    #[serde(flatten)]
    record: RecordView,
    /// The key id that opened the outcome (`--decrypt`).
    #[serde(skip_serializing_if = "Option::is_none")]
    decrypted_with: Option<String>,
}

/// `record` with its outcome opened by `keys`, and the key id that sealed
/// it (`None`: it was not sealed). A key the keyring lacks is
/// [`oncely::Error::CodecKeyMissing`].
fn decrypt(keys: &Keyring, mut record: Record) -> Result<(Record, Option<String>)> {
    let Some(stored) = record.outcome.take() else {
        return Ok((record, None));
    };
    let key_id = Envelope::parse(stored.as_bytes()).map(|e| e.key_id().to_owned());
    record.outcome = Some(keys.open(&record.key, &stored)?);
    Ok((record, key_id))
}

/// Reads the record of a displayed key (`tenant/kind:subject`). An invalid
/// key fails with [`oncely::Error::InvalidKey`] before anything connects.
pub async fn get(database_url: &str, key: &str) -> Result<Read<Option<Record>>> {
    let key = EffectKey::parse(key)?;
    with_ledger(
        database_url,
        Access::ReadOnly,
        |l| async move { l.get(&key).await },
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use oncely::Error;

    #[tokio::test]
    async fn bad_input_is_refused_before_connecting() {
        // The URL is unreachable: a round trip would fail differently.
        let url = "postgres://nobody@127.0.0.1:1/none";
        for key in ["", "no-slash", "t/no-colon", "t/:subject", "bad tenant/k:s"] {
            let err = get(url, key).await.unwrap_err();
            assert!(matches!(err, Error::InvalidKey { .. }), "{key:?}: {err:?}");
        }
    }
}
