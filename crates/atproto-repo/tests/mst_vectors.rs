//! atproto's MST interop vectors (CC0, `fixtures/interop/mst/`): key heights and common
//! prefix lengths.

use atproto_repo::mst::{common_prefix_len, key_height};

fn fixture(name: &str) -> serde_json::Value {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/interop/mst").join(name);
    serde_json::from_str(&std::fs::read_to_string(p).expect("fixture")).expect("JSON")
}

#[test]
fn key_heights_match_the_vectors() {
    let cases = fixture("key_heights.json");
    let cases = cases.as_array().expect("cases");
    assert!(cases.len() >= 9);
    for c in cases {
        let key = c["key"].as_str().expect("key");
        assert_eq!(u64::from(key_height(key.as_bytes())), c["height"].as_u64().expect("height"), "{key:?}");
    }
}

#[test]
fn common_prefixes_match_the_vectors() {
    for c in fixture("common_prefix.json").as_array().expect("cases") {
        let (l, r) = (c["left"].as_str().expect("left"), c["right"].as_str().expect("right"));
        assert_eq!(
            common_prefix_len(l.as_bytes(), r.as_bytes()) as u64,
            c["len"].as_u64().expect("len"),
            "{l:?} {r:?}"
        );
    }
}
