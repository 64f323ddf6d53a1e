//! Embeds every `migrations/NNNN_topic.sql` file and every `schema/*.sql` file, in file-name order, into the
//! library.
use std::{env, fs, path::Path, path::PathBuf};

fn sql_files(dir: &Path) -> Vec<PathBuf> {
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{} must exist: {e}", dir.display()))
        .map(|entry| entry.expect("readable SQL directory").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "sql"))
        .collect();
    files.sort();
    for path in &files {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    files
}

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());

    let mut migrations = String::from("&[\n");
    for path in sql_files(&root.join("migrations")) {
        let stem = path.file_stem().unwrap().to_str().expect("utf-8 file name");
        let (version, name) = stem
            .split_once('_')
            .unwrap_or_else(|| panic!("migration {stem} must be named NNNN_topic.sql"));
        assert!(
            version.len() == 4 && version.bytes().all(|b| b.is_ascii_digit()),
            "migration {stem} must start with a four-digit version"
        );
        migrations.push_str(&format!(
            "    Migration {{ version: {version:?}, name: {name:?}, sql: include_str!({:?}) }},\n",
            path.display().to_string()
        ));
    }
    migrations.push(']');
    fs::write(out_dir.join("migrations.rs"), migrations).expect("write migrations.rs");

    let mut schema = String::from("&[\n");
    for path in sql_files(&root.join("schema")) {
        let name = path.file_name().unwrap().to_str().expect("utf-8 file name");
        schema.push_str(&format!(
            "    SchemaFile {{ name: {name:?}, sql: include_str!({:?}) }},\n",
            path.display().to_string()
        ));
    }
    schema.push(']');
    fs::write(out_dir.join("schema.rs"), schema).expect("write schema.rs");
}
