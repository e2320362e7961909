//! The decoder: a frame's header and body read field by field from strict DAG-CBOR,
//! borrowing every string and byte string from the frame.

use super::{Account, Action, Commit, ErrorFrame, Frame, Identity, Info, MAX_SEQ, Message, RepoOp, Sync};
use crate::cbor::Reader;
use crate::cid::Cid;
use crate::error::{CborError, DecodeError};

/// Decodes one frame (header and body), fully validating it, without records.
pub fn decode(bytes: &[u8]) -> Result<Frame<'_>, DecodeError> {
    let mut r = Reader::new(bytes);
    let (op, t) = header(&mut r)?;
    let cb = |source| DecodeError::Cbor { part: "body", source };
    let frame = match op {
        1 => {
            let t = t.ok_or(DecodeError::MissingType)?;
            Frame::Message(match t {
                "#commit" => Message::Commit(commit(&mut r)?),
                "#sync" => Message::Sync(sync(&mut r)?),
                "#identity" => Message::Identity(identity(&mut r)?),
                "#account" => Message::Account(account(&mut r)?),
                "#info" => Message::Info(info(&mut r)?),
                _ => Message::Unknown { t, seq: unknown_seq(&mut r)? },
            })
        }
        -1 => Frame::Error(error_body(&mut r)?),
        other => return Err(DecodeError::UnknownOp(other)),
    };
    r.end().map_err(cb)?;
    Ok(frame)
}

fn header<'a>(r: &mut Reader<'a>) -> Result<(i64, Option<&'a str>), DecodeError> {
    let cb = |source| DecodeError::Cbor { part: "header", source };
    let n = r.map().map_err(cb)?;
    let (mut op, mut t, mut prev) = (None, None, None);
    for _ in 0..n {
        let k = r.key(prev).map_err(cb)?;
        prev = Some(k);
        match k {
            "t" => t = Some(r.str().map_err(cb)?),
            "op" => op = Some(r.i64().map_err(cb)?),
            _ => r.skip().map_err(cb)?,
        }
    }
    let op = op.ok_or(DecodeError::MissingField { kind: "header", field: "op" })?;
    Ok((op, t))
}

/// Walks a body map, handing each key to `f`, which must consume the value; checks order.
fn fields<'a>(
    r: &mut Reader<'a>,
    mut f: impl FnMut(&'a str, &mut Reader<'a>) -> Result<bool, DecodeError>,
) -> Result<(), DecodeError> {
    let cb = |source| DecodeError::Cbor { part: "body", source };
    let n = r.map().map_err(cb)?;
    let mut prev = None;
    for _ in 0..n {
        let k = r.key(prev).map_err(cb)?;
        prev = Some(k);
        if !f(k, r)? {
            r.skip().map_err(cb)?;
        }
    }
    Ok(())
}

fn cbody(source: CborError) -> DecodeError {
    DecodeError::Cbor { part: "body", source }
}

fn seq_value(r: &mut Reader<'_>) -> Result<u64, DecodeError> {
    let v = r.i64().map_err(cbody)?;
    u64::try_from(v)
        .ok()
        .filter(|&s| s <= MAX_SEQ)
        .ok_or_else(|| DecodeError::BadValue { field: "seq", detail: format!("{v} is outside 0..=2^53-1") })
}

fn link<'a>(r: &mut Reader<'a>, field: &'static str) -> Result<Cid<'a>, DecodeError> {
    let raw = r.link().map_err(cbody)?;
    Cid::from_bytes(raw).map_err(|source| DecodeError::Cid { field, source })
}

fn opt_link<'a>(r: &mut Reader<'a>, field: &'static str) -> Result<Option<Cid<'a>>, DecodeError> {
    if r.null() { Ok(None) } else { link(r, field).map(Some) }
}

fn opt_str<'a>(r: &mut Reader<'a>) -> Result<Option<&'a str>, DecodeError> {
    if r.null() { Ok(None) } else { r.str().map(Some).map_err(cbody) }
}

fn need<T>(v: Option<T>, kind: &'static str, field: &'static str) -> Result<T, DecodeError> {
    v.ok_or(DecodeError::MissingField { kind, field })
}

fn commit<'a>(r: &mut Reader<'a>) -> Result<Commit<'a>, DecodeError> {
    const K: &str = "#commit";
    let (mut seq, mut repo, mut cid, mut rev, mut since, mut blocks, mut ops, mut time) =
        (None, None, None, None, None, None, None, None);
    let (mut prev_data, mut too_big, mut rebase) = (None, false, false);
    fields(r, |k, r| {
        match k {
            "seq" => seq = Some(seq_value(r)?),
            "repo" => repo = Some(r.str().map_err(cbody)?),
            "commit" => cid = Some(link(r, "commit")?),
            "rev" => rev = Some(r.str().map_err(cbody)?),
            "since" => since = opt_str(r)?,
            "blocks" => blocks = Some(r.bytes().map_err(cbody)?),
            "ops" => ops = Some(repo_ops(r)?),
            "time" => time = Some(r.str().map_err(cbody)?),
            "prevData" => prev_data = opt_link(r, "prevData")?,
            "tooBig" => too_big = r.bool().map_err(cbody)?,
            "rebase" => rebase = r.bool().map_err(cbody)?,
            "blobs" => {
                let n = r.array().map_err(cbody)?;
                for _ in 0..n {
                    link(r, "blobs")?;
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(Commit {
        seq: need(seq, K, "seq")?,
        repo: need(repo, K, "repo")?,
        commit: need(cid, K, "commit")?,
        rev: need(rev, K, "rev")?,
        since,
        blocks: need(blocks, K, "blocks")?,
        ops: need(ops, K, "ops")?,
        prev_data,
        too_big,
        rebase,
        time: need(time, K, "time")?,
    })
}

fn repo_ops<'a>(r: &mut Reader<'a>) -> Result<Vec<RepoOp<'a>>, DecodeError> {
    const K: &str = "repoOp";
    let n = r.array().map_err(cbody)?;
    // Relays cap ops at 200; never pre-allocate from an untrusted length.
    let mut ops = Vec::with_capacity(n.min(256) as usize);
    for _ in 0..n {
        let (mut action, mut path, mut cid, mut prev, mut has_cid) = (None, None, None, None, false);
        fields(r, |k, r| {
            match k {
                "action" => {
                    action = Some(match r.str().map_err(cbody)? {
                        "create" => Action::Create,
                        "update" => Action::Update,
                        "delete" => Action::Delete,
                        other => {
                            return Err(DecodeError::BadValue {
                                field: "action",
                                detail: format!("unknown action {other:?}"),
                            });
                        }
                    });
                }
                "path" => path = Some(r.str().map_err(cbody)?),
                "cid" => {
                    has_cid = true;
                    cid = opt_link(r, "op cid")?;
                }
                "prev" => prev = opt_link(r, "op prev")?,
                _ => return Ok(false),
            }
            Ok(true)
        })?;
        let action = need(action, K, "action")?;
        if !has_cid {
            return Err(DecodeError::MissingField { kind: K, field: "cid" });
        }
        if action != Action::Delete && cid.is_none() {
            return Err(DecodeError::BadValue {
                field: "cid",
                detail: format!("{} op without a CID", action.as_str()),
            });
        }
        ops.push(RepoOp { action, path: need(path, K, "path")?, cid, prev });
    }
    Ok(ops)
}

fn sync<'a>(r: &mut Reader<'a>) -> Result<Sync<'a>, DecodeError> {
    const K: &str = "#sync";
    let (mut seq, mut did, mut blocks, mut rev, mut time) = (None, None, None, None, None);
    fields(r, |k, r| {
        match k {
            "seq" => seq = Some(seq_value(r)?),
            "did" => did = Some(r.str().map_err(cbody)?),
            "blocks" => blocks = Some(r.bytes().map_err(cbody)?),
            "rev" => rev = Some(r.str().map_err(cbody)?),
            "time" => time = Some(r.str().map_err(cbody)?),
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(Sync {
        seq: need(seq, K, "seq")?,
        did: need(did, K, "did")?,
        blocks: need(blocks, K, "blocks")?,
        rev: need(rev, K, "rev")?,
        time: need(time, K, "time")?,
    })
}

fn identity<'a>(r: &mut Reader<'a>) -> Result<Identity<'a>, DecodeError> {
    const K: &str = "#identity";
    let (mut seq, mut did, mut time, mut handle) = (None, None, None, None);
    fields(r, |k, r| {
        match k {
            "seq" => seq = Some(seq_value(r)?),
            "did" => did = Some(r.str().map_err(cbody)?),
            "time" => time = Some(r.str().map_err(cbody)?),
            "handle" => handle = opt_str(r)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(Identity { seq: need(seq, K, "seq")?, did: need(did, K, "did")?, time: need(time, K, "time")?, handle })
}

fn account<'a>(r: &mut Reader<'a>) -> Result<Account<'a>, DecodeError> {
    const K: &str = "#account";
    let (mut seq, mut did, mut time, mut active, mut status) = (None, None, None, None, None);
    fields(r, |k, r| {
        match k {
            "seq" => seq = Some(seq_value(r)?),
            "did" => did = Some(r.str().map_err(cbody)?),
            "time" => time = Some(r.str().map_err(cbody)?),
            "active" => active = Some(r.bool().map_err(cbody)?),
            "status" => status = opt_str(r)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(Account {
        seq: need(seq, K, "seq")?,
        did: need(did, K, "did")?,
        time: need(time, K, "time")?,
        active: need(active, K, "active")?,
        status,
    })
}

fn info<'a>(r: &mut Reader<'a>) -> Result<Info<'a>, DecodeError> {
    let (mut name, mut message) = (None, None);
    fields(r, |k, r| {
        match k {
            "name" => name = Some(r.str().map_err(cbody)?),
            "message" => message = opt_str(r)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(Info { name: need(name, "#info", "name")?, message })
}

fn error_body<'a>(r: &mut Reader<'a>) -> Result<ErrorFrame<'a>, DecodeError> {
    let (mut error, mut message) = (None, None);
    fields(r, |k, r| {
        match k {
            "error" => error = Some(r.str().map_err(cbody)?),
            "message" => message = opt_str(r)?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(ErrorFrame { error: need(error, "error frame", "error")?, message })
}

fn unknown_seq(r: &mut Reader<'_>) -> Result<Option<u64>, DecodeError> {
    let mut seq = None;
    if r.rest().first().is_some_and(|b| b >> 5 == 5) {
        fields(r, |k, r| {
            if k == "seq" {
                seq = Some(seq_value(r)?);
                return Ok(true);
            }
            Ok(false)
        })?;
    } else {
        r.skip().map_err(cbody)?;
    }
    Ok(seq)
}

/// Where the body's `seq` value lies in a frame, as a byte range, for tools that
/// renumber frames (`relay-sim`'s seq reset) without re-encoding the rest.
#[must_use]
pub fn seq_span(bytes: &[u8]) -> Option<std::ops::Range<usize>> {
    let mut r = Reader::new(bytes);
    header(&mut r).ok()?;
    let n = r.map().ok()?;
    let mut prev = None;
    for _ in 0..n {
        let k = r.key(prev).ok()?;
        prev = Some(k);
        let start = r.position();
        r.skip().ok()?;
        if k == "seq" {
            return Some(start..r.position());
        }
    }
    None
}

/// The seq of a frame that may not decode as a whole, if its body got as far as a valid
/// `seq`: where a bad frame sits in the sequence.
#[must_use]
pub fn peek_seq(bytes: &[u8]) -> Option<u64> {
    let span = seq_span(bytes)?;
    Reader::new(&bytes[span]).u64().ok()
}
