//! What an operator of this binary does about an error the libraries report in their own
//! words: the `FIREKEEPER_*` setting or the `firekeeper` command that gets past it.

use consumer::{Error, Fatal};
use relay_client::SubscribeError;

/// The way out of `e`, naming this binary's settings and commands; `None` when the error
/// says all there is to say.
#[must_use]
pub fn advice(e: &anyhow::Error) -> Option<String> {
    if let Some(s) = e.downcast_ref::<checkpoint::StoreError>() {
        return store(s);
    }
    let Error::Fatal(f) = e.downcast_ref::<Error>()? else { return None };
    Some(match f {
        Fatal::BadFrame(SubscribeError::BadFrame { relay, seq, .. }) => format!(
            "set FIREKEEPER_BAD_FRAME=skip to skip such frames, or move the cursor past it with \
             `firekeeper cursor set --relay {relay} {seq}`"
        ),
        Fatal::BadFrame(SubscribeError::FrameTooLarge { .. }) => {
            "raise FIREKEEPER_MAX_FRAME_BYTES, or set FIREKEEPER_BAD_FRAME=skip".to_owned()
        }
        Fatal::FutureCursor(SubscribeError::FutureCursor { relay, .. }) => format!(
            "set FIREKEEPER_FUTURE_CURSOR=live to accept the gap, or fix the cursor with \
             `firekeeper cursor set --relay {relay} <seq>`"
        ),
        Fatal::NoCursor { role, .. } => format!(
            "on a deployment's very first start set FIREKEEPER_START=oldest (everything the relay still has) or \
             live (only what the relay publishes from now on: everything before is skipped, never delivered); \
             if this deployment ran before, the store lost its data: set the cursor to the last seq your \
             downstream has with `firekeeper cursor set --relay {role} <seq>`; then restart"
        ),
        Fatal::CursorCorrupt { role, .. } => format!(
            "set the cursor with `firekeeper cursor set --relay {role} <seq>` (the seq of the last event your \
             downstream has), then restart"
        ),
        Fatal::LegacyAmbiguous(s) => return store(s),
        Fatal::Invalid { .. } => {
            "FIREKEEPER_INVALID=mark hands invalid events to the sink as `#invalid` and goes on".to_owned()
        }
        _ => return None,
    })
}

/// Advice for a cursor store's error.
fn store(e: &checkpoint::StoreError) -> Option<String> {
    matches!(e, checkpoint::StoreError::LegacyAmbiguous { .. }).then(|| {
        "preseed the cursor with `firekeeper cursor set`, then delete the legacy key \
         (FIREKEEPER_LEGACY_CURSOR_PREFIX)"
            .to_owned()
    })
}

#[cfg(test)]
mod tests {
    use relay_client::{DecodeError, RelayRole};

    use super::*;

    #[test]
    fn fatal_errors_get_the_binarys_words() {
        let bad = SubscribeError::BadFrame {
            relay: RelayRole::Primary,
            seq: 700,
            error: DecodeError::TooLarge { size: 9, max: 8 },
        };
        let e = anyhow::Error::from(Error::Fatal(Fatal::BadFrame(bad)));
        let a = advice(&e).expect("advice");
        assert!(a.contains("FIREKEEPER_BAD_FRAME=skip") && a.contains("cursor set --relay primary 700"), "{a}");
        let lost = Error::Fatal(Fatal::NoCursor { role: RelayRole::Secondary, fingerprint: "f".into(), token: 3 });
        let said = advice(&lost.into()).expect("advice");
        assert!(said.contains("firekeeper cursor set --relay secondary"), "{said}");
        assert!(
            said.contains("live (only what the relay publishes from now on: everything before is skipped"),
            "{said}"
        );
        assert_eq!(advice(&anyhow::anyhow!("something else")), None);
    }
}
