//! The README's compatibility table cannot go stale: every row marked *modelled* names symbols
//! the built library exports, every row marked *not exported* names symbols it does not.

mod symbols;

use symbols::exported;

/// The sections the table must cover (CUDA 12.8 driver API).
const SECTIONS: [&str; 8] = [
    "Memory Management",
    "Virtual Memory Management",
    "Stream Ordered Memory Allocator",
    "Unified Addressing",
    "Peer Context Memory Access",
    "Context Management",
    "Stream Management",
    "Event Management",
];

/// One table row.
struct Row {
    section: String,
    name: String,
    symbols: Vec<String>,
    modelled: bool,
}

/// The rows under "## Compatibility table", by `###` section.
fn rows() -> Vec<Row> {
    let readme = include_str!("../README.md");
    let table = readme.split("## Compatibility table").nth(1).expect("README has a compatibility table");
    let mut section = String::new();
    let mut rows = Vec::new();
    for line in table.lines() {
        if let Some(title) = line.strip_prefix("### ") {
            section = title.trim().to_owned();
            continue;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // "| name | symbols | status | notes |" splits into 6 cells, the outer two empty.
        if cells.len() != 6 || !cells[1].starts_with("cu") {
            continue;
        }
        let symbols = cells[2].split(',').map(|s| s.trim().trim_matches('`').to_owned()).collect();
        let modelled = match cells[3] {
            "modelled" => true,
            "not exported" => false,
            other => panic!("row {}: status {other:?} is neither `modelled` nor `not exported`", cells[1]),
        };
        if !modelled {
            assert!(!cells[4].is_empty(), "row {}: a not-exported row says why", cells[1]);
        }
        rows.push(Row { section: section.clone(), name: cells[1].to_owned(), symbols, modelled });
    }
    rows
}

#[test]
fn every_row_matches_the_librarys_exports() {
    let rows = rows();
    let mut wrong = Vec::new();
    for row in &rows {
        for symbol in &row.symbols {
            if exported(symbol) != row.modelled {
                let claim =
                    if row.modelled { "modelled, but it is not exported" } else { "not exported, but it is" };
                wrong.push(format!("{} / {}: `{symbol}` is marked {claim}", row.section, row.name));
            }
        }
    }
    assert!(wrong.is_empty(), "the compatibility table is stale:\n{}", wrong.join("\n"));
}

#[test]
fn the_table_covers_every_section_once() {
    let rows = rows();
    for section in SECTIONS {
        let n = rows.iter().filter(|r| r.section == section).count();
        assert!(n > 0, "section {section} has no rows");
    }
    assert!(rows.iter().all(|r| SECTIONS.contains(&r.section.as_str())), "rows outside the listed sections");
    let mut names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
    names.sort_unstable();
    let before = names.len();
    names.dedup();
    assert_eq!(names.len(), before, "an entry point is listed twice");
    assert!(rows.iter().any(|r| r.modelled) && rows.iter().any(|r| !r.modelled));
    assert!(rows.iter().all(|r| !r.symbols.is_empty() && r.symbols.iter().all(|s| s.starts_with("cu"))));
}

#[test]
fn modelled_v2_entry_points_also_export_their_plain_name() {
    // A real libcuda exports the v1 symbol beside every `_v2` (cuda.h's internal section), and
    // programs built before CUDA 3.2 or bindings that use public names link against it.
    let mut missing = Vec::new();
    for row in rows().iter().filter(|r| r.modelled) {
        for symbol in row.symbols.iter().filter(|s| s.ends_with("_v2") && *s != &row.name) {
            let plain = symbol.trim_end_matches("_v2");
            if !row.symbols.iter().any(|s| s == plain) || !exported(plain) {
                missing.push(format!("{}: `{symbol}` is modelled but `{plain}` is not", row.name));
            }
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
