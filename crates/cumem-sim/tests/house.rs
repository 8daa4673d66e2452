//! The simulator's layering: `src/exports/` holds the C-ABI shims, everything else is the model,
//! and the model never reaches back into the shims. A model module that imports from `exports/`
//! puts semantics behind an entry point, where the next reader will not look for them.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read the source directory") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_model_module_imports_from_exports() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let exports = src.join("exports");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let models: Vec<&PathBuf> = files.iter().filter(|p| !p.starts_with(&exports)).collect();
    assert!(models.len() > 10, "the model modules were found under {}", src.display());
    let offenders: Vec<String> = models
        .iter()
        .flat_map(|path| {
            let text = std::fs::read_to_string(path).expect("read a source file");
            text.lines()
                .enumerate()
                .filter(|(_, line)| line.contains("crate::exports") || line.contains("super::exports"))
                .map(|(n, line)| format!("{}:{}: {}", path.display(), n + 1, line.trim()))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(offenders.is_empty(), "model modules import from exports/:\n{}", offenders.join("\n"));
}
