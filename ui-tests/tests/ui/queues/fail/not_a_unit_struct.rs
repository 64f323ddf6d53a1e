// Proves: `#[queue]` only goes on a unit struct; fields, generics and other items are errors on the offending tokens.
use pgflow_runtime::queue;

#[queue("with_fields")]
pub struct WithFields {
    pub id: u32,
}

#[queue("tuple")]
pub struct Tuple(u32);

#[queue("generic")]
pub struct Generic<T>(std::marker::PhantomData<T>);

#[queue("an_enum")]
pub enum AnEnum {
    A,
}

fn main() {}
