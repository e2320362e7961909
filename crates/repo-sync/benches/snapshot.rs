//! Repo sync's cost per repo, on the reference PDS's repos: the 20,000-record repo and
//! the eight small ones (32–34 records), each resolved through a local PLC, fetched from
//! a local PDS on loopback, verified whole (every block's CID, the commit's signature,
//! the whole tree, every record) and rendered to JSON as a resync delivers it; and, beside
//! them in the same run, the verification alone on bytes in memory (the ceiling without
//! HTTP and rendering). The reference TypeScript library verifies the large repo at about
//! 10,900 records/s on this kind of machine (fixtures/repos/README.md).

#![allow(missing_docs)] // criterion_group! generates an undocumented fn

use std::collections::HashMap;
use std::time::Duration;

use atproto_identity::resolver::{Resolver, ResolverConfig};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use repo_sync::fetch::Limits;
use repo_sync::snapshot::fetch_snapshot;

const LARGE: &str = "did:plc:d255tkvufzfkpckokc332in6";

// The allocator the binary uses: rendering allocates per record, and glibc's malloc
// contends between the two rendering threads where jemalloc does not.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let reference = testkit::fold::reference();
    let serve: HashMap<String, String> = reference.keys().map(|d| (d.clone(), d.clone())).collect();
    let small: Vec<String> = reference.keys().filter(|d| *d != LARGE).cloned().collect();
    let (resolver, client) = rt.block_on(async {
        let base = testkit::pds::start(serve).await;
        let plc = testkit::plc::Plc::start(testkit::pds::docs(&base)).await;
        let cfg = ResolverConfig { plc_url: plc.url(), allow_private: true, ..ResolverConfig::default() };
        // The PLC server lives as long as the runtime's tasks.
        std::mem::forget(plc);
        // The resolver installs the process's TLS provider, which the client needs.
        let resolver = Resolver::new(cfg).expect("resolver");
        let guard = guarded_http::Guard { allow_private: true, max_redirects: 3 };
        let client = guarded_http::Client::new(guard, reqwest::Client::builder()).expect("client");
        (resolver, client)
    });
    let limits = Limits::default();
    let now_us = 4_000_000_000_000_000;
    let mut g = c.benchmark_group("repo-sync");
    g.sample_size(10).measurement_time(Duration::from_secs(10));
    g.throughput(Throughput::Elements(20_000));
    g.bench_function("large repo: fetch + verify + render, records", |b| {
        b.iter(|| {
            let records = rt.block_on(async {
                let (_, parts) = fetch_snapshot(
                    &resolver,
                    &client,
                    repo_sync::check::Route { hosts: &repo_sync::hosts::Hosts::default(), via: None },
                    LARGE,
                    &limits,
                    now_us,
                    None,
                )
                .await
                .expect("snapshot");
                parts.collect().await.expect("parts")
            });
            assert_eq!(records.len(), 20_000);
        });
    });
    let car = testkit::pds::car(LARGE);
    let key = atproto_crypto::PublicKey::from_did_key("did:key:zQ3shtM82rrgPUe98VePrgPAYF1GA6qFPTHSMZPXPuoTkZiNs")
        .expect("the large repo's key");
    g.bench_function("large repo: verify only (bytes in memory), records", |b| {
        b.iter(|| {
            let s = atproto_repo::repo::verify_repo_bytes(&car, LARGE, &key, now_us).expect("verified");
            assert_eq!(s.records.len(), 20_000);
        });
    });
    g.throughput(Throughput::Elements(small.len() as u64));
    g.bench_function("small repos, 4 at a time: fetch + verify + render, repos", |b| {
        b.iter(|| {
            rt.block_on(async {
                let mut set = tokio::task::JoinSet::new();
                for chunk in small.chunks(small.len().div_ceil(4)) {
                    let (resolver, client, limits) = (resolver.clone(), client.clone(), limits.clone());
                    let chunk = chunk.to_vec();
                    set.spawn(async move {
                        for d in &chunk {
                            fetch_snapshot(
                                &resolver,
                                &client,
                                repo_sync::check::Route { hosts: &repo_sync::hosts::Hosts::default(), via: None },
                                d,
                                &limits,
                                now_us,
                                None,
                            )
                            .await
                            .expect("snapshot")
                            .1
                            .collect()
                            .await
                            .expect("parts");
                        }
                    });
                }
                while set.join_next().await.is_some() {}
            });
        });
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
