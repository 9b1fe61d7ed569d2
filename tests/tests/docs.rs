//! The README's configuration reference stays in step with the
//! configuration type: every key the file accepts is documented, and every
//! documented key is accepted.

use std::path::PathBuf;

use cdc_forwarder::config::FILE_KEYS;

#[test]
fn every_configuration_key_is_documented_and_every_documented_key_exists() {
    let readme =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .expect("README.md");
    let section = readme
        .split("### Configuration reference")
        .nth(1)
        .expect("README has a configuration reference")
        .split("\n#")
        .next()
        .unwrap_or_default();
    let documented: Vec<&str> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .collect();
    for key in FILE_KEYS {
        assert!(
            documented.contains(key),
            "{key} is not in the README's configuration reference"
        );
    }
    for key in &documented {
        assert!(
            FILE_KEYS.contains(key),
            "the README documents {key}, which the file does not accept"
        );
    }
}
