//! The documentation stays true to the code and to itself: the
//! configuration reference lists every option of the one declaration
//! (`cdc_forwarder::options`) under its file key with its flag and
//! environment variable, and nothing else; and every link of the README and
//! the book to a file or a heading points at one that exists (mdBook's link
//! check sees files, not headings).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use cdc_forwarder::options::reference;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_option_is_documented_with_its_flag_and_variable_and_nothing_else_is() {
    let reference_page = read(&root().join("docs/src/configuration.md"));
    let rows: Vec<&str> = reference_page
        .lines()
        .filter(|l| l.starts_with("| `"))
        .collect();
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
            .unwrap_or_else(|| panic!("{} is not in the configuration reference", option.key));
        for name in option.flag.iter().chain(option.env.iter()) {
            assert!(
                row.contains(&format!("`{name}`")),
                "the configuration reference's row of {} does not name {name}: {row}",
                option.key
            );
        }
    }
    for key in &documented {
        assert!(
            options.iter().any(|o| o.key == *key),
            "the configuration reference documents {key}, which is no option"
        );
    }
}

/// The anchor a heading gets, as mdBook and GitHub make it: lower case,
/// spaces as `-`, other punctuation left out.
fn anchor(heading: &str) -> String {
    heading
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_ascii_lowercase())
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// The lines of a Markdown text outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|l| {
            if l.starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

fn anchors(text: &str) -> HashSet<String> {
    prose(text)
        .iter()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| anchor(l.trim_start_matches('#').trim()))
        .collect()
}

/// The targets of inline links, `[text](target)`, outside code.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in prose(text) {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            if let Some(end) = rest.find(')') {
                found.push(rest[..end].to_owned());
                rest = &rest[end..];
            }
        }
    }
    found
}

#[test]
fn every_link_of_the_readme_and_the_book_reaches_its_file_and_heading() {
    let mut pages: Vec<PathBuf> = vec![root().join("README.md"), root().join("CHANGELOG.md")];
    for entry in std::fs::read_dir(root().join("docs/src")).expect("docs/src") {
        let path = entry.expect("docs/src entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    let mut checked = 0;
    for page in &pages {
        let text = read(page);
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (file, fragment) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() {
                page.clone()
            } else {
                page.parent().expect("a page's folder").join(file)
            };
            assert!(
                target.exists(),
                "{} links to {link}, which is no file",
                page.display()
            );
            if !fragment.is_empty() {
                assert!(
                    anchors(&read(&target)).contains(fragment),
                    "{} links to {link}, but {} has no heading #{fragment}",
                    page.display(),
                    target.display()
                );
            }
            checked += 1;
        }
    }
    assert!(
        checked > 40,
        "only {checked} links found: is the parser blind?"
    );
}

#[test]
fn headings_become_the_anchors_that_mdbook_and_github_make() {
    assert_eq!(
        anchor("Polling relays: where there can be no slot"),
        "polling-relays-where-there-can-be-no-slot"
    );
    assert_eq!(
        anchor("`outbox.emit_events` (batch)"),
        "outboxemit_events-batch"
    );
}
