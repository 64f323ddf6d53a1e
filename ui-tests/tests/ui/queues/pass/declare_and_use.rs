// Proves: `#[queue]` implements `Queue` with the literal as `NAME`, keeps docs, visibility and other attributes, adds the marker derives, accepts a 47-character name and `crate = ..`.
use pgflow_runtime::{queue, Queue};

mod reexport {
    pub use pgflow_runtime as rt;
}

/// Classification work of every community flow version.
#[queue("classify_threads")]
pub struct ClassifyThreads;

#[queue("_private_9")]
#[derive(PartialOrd)]
struct Private;

#[queue("a_queue_name_of_exactly_forty_seven_characters_")]
pub struct AtTheLimit;

#[queue("billing", crate = "crate::reexport::rt")]
pub struct Billing;

fn marker<T: Copy + Default + Eq + std::hash::Hash + std::fmt::Debug + Send + Sync + 'static>() {}

fn main() {
    assert_eq!(ClassifyThreads::NAME, "classify_threads");
    assert_eq!(<Private as Queue>::NAME, "_private_9");
    assert_eq!(AtTheLimit::NAME.len(), 47);
    assert_eq!(Billing::NAME, "billing");
    marker::<ClassifyThreads>();
    marker::<Private>();
    assert_eq!(format!("{:?}", Private), "Private");
    assert!(Private <= Private);
    assert_eq!(ClassifyThreads, ClassifyThreads::default());
}
