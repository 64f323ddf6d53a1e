//! Embeds every `migrations/NNNN_topic.sql` file, in file-name order, into the library.
use std::{env, fs, path::PathBuf};

fn main() {
    let dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("migrations");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .expect("pgflow-sql/migrations must exist")
        .map(|entry| entry.expect("readable migrations dir").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "sql"))
        .collect();
    files.sort();
    let mut out = String::from("&[\n");
    for path in &files {
        println!("cargo:rerun-if-changed={}", path.display());
        let stem = path.file_stem().unwrap().to_str().expect("utf-8 file name");
        let (version, name) = stem
            .split_once('_')
            .unwrap_or_else(|| panic!("migration {stem} must be named NNNN_topic.sql"));
        assert!(
            version.len() == 4 && version.bytes().all(|b| b.is_ascii_digit()),
            "migration {stem} must start with a four-digit version"
        );
        out.push_str(&format!(
            "    Migration {{ version: {version:?}, name: {name:?}, sql: include_str!({:?}) }},\n",
            path.display().to_string()
        ));
    }
    out.push(']');
    let target = PathBuf::from(env::var("OUT_DIR").unwrap()).join("migrations.rs");
    fs::write(target, out).expect("write migrations.rs");
}
