//! Enums the driver reports by a stable name (`as_str`): displayed, compared with and
//! serialized as that name, so the CLI, the API and `/metrics` show the strings they always have.

macro_rules! by_name {
    ($t:ty) => {
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl PartialEq<&str> for $t {
            fn eq(&self, name: &&str) -> bool {
                self.as_str() == *name
            }
        }

        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }
    };
}
