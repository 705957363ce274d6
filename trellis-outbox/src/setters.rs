//! Builder setters, written once for every builder of the crate.

/// Defines plain builder setters. Each `name(value: Type) => field;` (or `=> a.field;` for
/// a field of a field), with its doc comment before it, becomes
/// `pub fn name(mut self, value: Type) -> Self { self.field = value; self }`.
/// Setters that do more than store their value are written by hand.
macro_rules! setters {
    ($($(#[$attr:meta])* $name:ident($value:ident: $ty:ty) => $($field:ident).+;)*) => {
        $(
            $(#[$attr])*
            pub fn $name(mut self, $value: $ty) -> Self {
                self.$($field).+ = $value;
                self
            }
        )*
    };
}
pub(crate) use setters;
