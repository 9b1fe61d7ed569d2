//! The README's configuration reference stays in step with the options'
//! one declaration (`cdc_forwarder::options`): every option is documented
//! under its file key with its flag and environment variable, and every
//! documented key is an option.

use std::path::PathBuf;

use cdc_forwarder::options::reference;

#[test]
fn every_option_is_documented_with_its_flag_and_variable_and_nothing_else_is() {
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
    let rows: Vec<&str> = section.lines().filter(|l| l.starts_with("| `")).collect();
    let documented: Vec<&str> = rows
        .iter()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .collect();
    let options = reference();
    for option in &options {
        let row = rows
            .iter()
            .find(|row| row.starts_with(&format!("| `{}` |", option.key)))
            .unwrap_or_else(|| {
                panic!(
                    "{} is not in the README's configuration reference",
                    option.key
                )
            });
        for name in option.flag.iter().chain(option.env.iter()) {
            assert!(
                row.contains(&format!("`{name}`")),
                "the README's row of {} does not name {name}: {row}",
                option.key
            );
        }
    }
    for key in &documented {
        assert!(
            options.iter().any(|o| o.key == *key),
            "the README documents {key}, which is no option"
        );
    }
}
