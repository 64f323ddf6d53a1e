//! trybuild driver: every `tests/ui/<topic>/pass/*.rs` must compile and run, every
//! `tests/ui/<topic>/fail/*.rs` must fail with the error recorded in its `.stderr`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/*/pass/*.rs");
    t.compile_fail("tests/ui/*/fail/*.rs");
}
