//! `wire.proto` (the wire's document) and the prost structs in `src/` (its code) say the same:
//! the same messages, each with the same fields (name, tag, type), oneofs with the same variants,
//! enums with the same values; and the document has a comment on every field and value. Both sides are read as text, the structs by their `#[prost(..)]`
//! attributes, so a message, field or value added to one and not the other fails here.

use std::collections::BTreeMap;
use std::path::Path;

/// Message → tag → (field name, type as proto3 writes it; a oneof's as "oneof NAME TYPE").
type Messages = BTreeMap<String, BTreeMap<u32, (String, String)>>;
/// Enum → value → name (proto3 style: `ERROR_KIND_BAD_FRAME`).
type Enums = BTreeMap<String, BTreeMap<i32, String>>;

#[derive(Default)]
struct Schema {
    messages: Messages,
    enums: Enums,
}

/// `BadApiKey` → `bad_api_key`, `Bf16` → `bf16`.
fn snake(camel: &str) -> String {
    let mut out = String::new();
    let mut prev_lower = false;
    for c in camel.chars() {
        if c.is_ascii_uppercase() && prev_lower {
            out.push('_');
        }
        prev_lower = c.is_ascii_lowercase() || c.is_ascii_digit();
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// The last path segment inside `Option<..>` / `Vec<..>`: `Option<crate::SignedTicket>` → `SignedTicket`.
fn type_name(rust: &str) -> String {
    let inner = rust.trim().trim_start_matches("Option<").trim_start_matches("Vec<").trim_end_matches(',').trim_end_matches('>');
    inner.rsplit("::").next().unwrap_or(inner).trim_matches('"').to_string()
}

/// The items of a `#[prost(..)]` attribute, split at commas outside quotes: (key, value).
fn prost_items(attr: &str) -> Option<Vec<(String, String)>> {
    let body = attr.strip_prefix("#[prost(")?.strip_suffix(")]")?;
    let (mut items, mut cur, mut quoted) = (Vec::new(), String::new(), false);
    for c in body.chars().chain([',']) {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                let (k, v) = cur.split_once('=').unwrap_or((&cur, ""));
                items.push((k.trim().to_string(), v.trim().to_string()));
                cur.clear();
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    Some(items)
}

/// A field's proto3 type from its prost attribute and its Rust type.
fn proto_type(items: &[(String, String)], rust_ty: &str) -> String {
    let has = |k: &str| items.iter().any(|(key, _)| key == k);
    let base = items
        .iter()
        .find_map(|(k, v)| match k.as_str() {
            "tag" | "optional" | "repeated" => None,
            "message" => Some(type_name(rust_ty)),
            "enumeration" => Some(type_name(v)),
            scalar => Some(scalar.to_string()),
        })
        .unwrap_or_else(|| panic!("a prost field with no type: {items:?}"));
    match (has("repeated"), has("optional") && !has("message")) {
        (true, _) => format!("repeated {base}"),
        (false, true) => format!("optional {base}"),
        _ => base,
    }
}

fn tag_of(items: &[(String, String)]) -> u32 {
    let tag = items.iter().find(|(k, _)| k == "tag").map(|(_, v)| v.trim_matches('"')).expect("a tag");
    tag.parse().expect("a numeric tag")
}

/// The prost structs of every file in `src/`.
fn parse_code(dir: &Path) -> Schema {
    enum In {
        Nothing,
        Message(String),
        Oneof(String),
        Enum(String),
    }
    let mut s = Schema::default();
    // Oneof enum → tag → (variant, type), and the fields that hold them: (message, field, oneof, tags).
    let mut oneofs: BTreeMap<String, BTreeMap<u32, (String, String)>> = BTreeMap::new();
    let mut holders: Vec<(String, String, String, Vec<u32>)> = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(dir).expect("src/").map(|e| e.expect("an entry").path()).collect();
    files.sort();
    for path in files.iter().filter(|p| p.extension().is_some_and(|e| e == "rs")) {
        let text = std::fs::read_to_string(path).expect("a source file");
        let (mut state, mut derive, mut attr) = (In::Nothing, "", None::<Vec<(String, String)>>);
        let mut lines = text.lines();
        while let Some(raw) = lines.next() {
            let mut line = raw.trim().to_string();
            // An attribute rustfmt wrapped over several lines.
            while line.starts_with("#[") && !line.ends_with(']') {
                line.push_str(lines.next().expect("an attribute's end").trim());
            }
            if line.starts_with("//") || line.is_empty() {
                continue;
            }
            if line.starts_with("#[derive(") {
                derive = ["prost::Message", "prost::Oneof", "prost::Enumeration"].into_iter().find(|d| line.contains(d)).unwrap_or("");
                continue;
            }
            if line.starts_with("#[prost(") {
                attr = prost_items(&line);
                continue;
            }
            if line.starts_with("#[") {
                continue;
            }
            match &state {
                In::Nothing => {
                    let opened = |kw: &str| raw.strip_prefix(kw).and_then(|r| r.split([' ', '{']).next()).map(str::to_string);
                    match (derive, opened("pub struct "), opened("pub enum ")) {
                        ("prost::Message", Some(name), _) => {
                            s.messages.insert(name.clone(), BTreeMap::new());
                            if !raw.ends_with("{}") {
                                state = In::Message(name);
                            }
                        }
                        ("prost::Oneof", _, Some(name)) => state = In::Oneof(name),
                        ("prost::Enumeration", _, Some(name)) => {
                            s.enums.insert(name.clone(), BTreeMap::new());
                            state = In::Enum(name);
                        }
                        _ => {}
                    }
                    derive = "";
                }
                _ if raw == "}" => state = In::Nothing,
                In::Message(m) => {
                    let items = attr.take().unwrap_or_else(|| panic!("{}: a field with no #[prost]: {raw:?}", path.display()));
                    let (field, ty) = line.trim_start_matches("pub ").split_once(':').expect("name: Type");
                    if let Some((_, oneof)) = items.iter().find(|(k, _)| k == "oneof") {
                        let tags = items.iter().find(|(k, _)| k == "tags").expect("a oneof's tags").1.trim_matches('"');
                        let tags = tags.split(',').map(|t| t.trim().parse().expect("a numeric tag")).collect();
                        holders.push((m.clone(), field.to_string(), oneof.trim_matches('"').to_string(), tags));
                    } else {
                        let fields = s.messages.get_mut(m).expect("the message");
                        let dup = fields.insert(tag_of(&items), (field.to_string(), proto_type(&items, ty)));
                        assert!(dup.is_none(), "{m}: tag {} twice", tag_of(&items));
                    }
                }
                In::Oneof(o) => {
                    let items = attr.take().unwrap_or_else(|| panic!("{}: a variant with no #[prost]: {raw:?}", path.display()));
                    let (variant, ty) = line.split_once('(').expect("Variant(Type)");
                    oneofs
                        .entry(o.clone())
                        .or_default()
                        .insert(tag_of(&items), (variant.to_string(), type_name(ty.trim_end_matches("),"))));
                }
                In::Enum(e) => {
                    let (variant, value) = line.trim_end_matches(',').split_once(" = ").expect("Variant = N");
                    let name = format!("{}_{}", snake(e), snake(variant)).to_uppercase();
                    s.enums.get_mut(e).expect("the enum").insert(value.parse().expect("a numeric value"), name);
                }
            }
        }
    }
    for (m, field, oneof, tags) in holders {
        let variants = oneofs.get(&oneof).unwrap_or_else(|| panic!("{m}.{field}: no oneof {oneof}"));
        assert_eq!(variants.keys().copied().collect::<Vec<u32>>(), tags, "{m}.{field}: the tags listed are not {oneof}'s variants'");
        let fields = s.messages.get_mut(&m).expect("the message");
        for (tag, (variant, ty)) in variants {
            fields.insert(*tag, (snake(variant), format!("oneof {field} {ty}")));
        }
    }
    s
}

/// The messages and enums of the document.
fn parse_doc(text: &str) -> Schema {
    let mut s = Schema::default();
    let (mut message, mut oneof, mut en) = (None::<String>, None::<String>, None::<String>);
    let mut commented = false;
    for (n, raw) in text.lines().enumerate() {
        let line = raw.split("//").next().unwrap_or("").trim().trim_end_matches(';');
        let words: Vec<&str> = line.split_whitespace().collect();
        let at = || format!("wire.proto:{}", n + 1);
        // Every field and value says what it is, on the line above it.
        let said = std::mem::replace(&mut commented, raw.trim_start().starts_with("//"));
        if words.contains(&"=") && (message.is_some() || en.is_some()) {
            assert!(said, "{}: {:?} has no comment", at(), raw.trim());
        }
        match words.as_slice() {
            [] | ["syntax", ..] | ["package", ..] | ["reserved", ..] => {}
            ["message", name, "{"] => {
                assert!(s.messages.insert(name.to_string(), BTreeMap::new()).is_none(), "{}: message {name} twice", at());
                message = Some(name.to_string());
            }
            ["oneof", name, "{"] => oneof = Some(name.to_string()),
            ["enum", name, "{"] => {
                assert!(s.enums.insert(name.to_string(), BTreeMap::new()).is_none(), "{}: enum {name} twice", at());
                en = Some(name.to_string());
            }
            ["}"] => {
                if oneof.take().is_none() && en.take().is_none() {
                    message.take().unwrap_or_else(|| panic!("{}: a '}}' closing nothing", at()));
                }
            }
            [name, "=", value] if en.is_some() => {
                let values = s.enums.get_mut(en.as_ref().expect("an enum")).expect("the enum");
                let value = value.parse().unwrap_or_else(|_| panic!("{}: not a value: {value}", at()));
                assert!(values.insert(value, name.to_string()).is_none(), "{}: value {value} twice", at());
            }
            [ty @ .., name, "=", tag] if message.is_some() && !ty.is_empty() => {
                let ty = match &oneof {
                    Some(o) => format!("oneof {o} {}", ty.join(" ")),
                    None => ty.join(" "),
                };
                let tag = tag.parse().unwrap_or_else(|_| panic!("{}: not a tag: {tag}", at()));
                let fields = s.messages.get_mut(message.as_ref().expect("a message")).expect("the message");
                assert!(fields.insert(tag, (name.to_string(), ty)).is_none(), "{}: tag {tag} twice", at());
            }
            _ => panic!("{}: not a line this test reads: {raw:?}", at()),
        }
    }
    assert!(message.is_none() && oneof.is_none() && en.is_none(), "wire.proto ends inside a block");
    s
}

/// Every difference between two maps of maps, as lines.
fn differences<K: Ord + std::fmt::Debug, V: PartialEq + std::fmt::Debug>(
    what: &str,
    doc: &BTreeMap<String, BTreeMap<K, V>>,
    code: &BTreeMap<String, BTreeMap<K, V>>,
) -> Vec<String> {
    let mut out = Vec::new();
    for name in doc.keys().chain(code.keys()).collect::<std::collections::BTreeSet<_>>() {
        match (doc.get(name), code.get(name)) {
            (Some(_), None) => out.push(format!("{what} {name}: in wire.proto, not in the code")),
            (None, Some(_)) => out.push(format!("{what} {name}: in the code, not in wire.proto")),
            (Some(d), Some(c)) => {
                for k in d.keys().chain(c.keys()).collect::<std::collections::BTreeSet<_>>() {
                    if d.get(k) != c.get(k) {
                        out.push(format!("{what} {name}, number {k:?}: wire.proto says {:?}, the code {:?}", d.get(k), c.get(k)));
                    }
                }
            }
            (None, None) => unreachable!("a name from one of the two"),
        }
    }
    out
}

#[test]
fn the_wire_document_names_every_message_field_and_value_of_the_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = parse_doc(&std::fs::read_to_string(root.join("wire.proto")).expect("wire.proto"));
    let code = parse_code(&root.join("src"));
    // The reader found what the crate has: a parse that quietly found nothing would pass.
    for m in ["Frame", "OpenSession", "TrackerFrame", "Ticket", "SignedTicket"] {
        assert!(code.messages.contains_key(m), "the code's reader missed message {m}");
    }
    assert_eq!(code.messages["Frame"].len(), 16, "Frame's oneof variants, as the code's reader found them");
    assert!(code.enums.contains_key("SeamDtype") && code.enums.contains_key("RefusalKind"));
    let mut wrong = differences("message", &doc.messages, &code.messages);
    wrong.extend(differences("enum", &doc.enums, &code.enums));
    assert!(wrong.is_empty(), "wire.proto and the prost structs differ:\n{}", wrong.join("\n"));
    println!("wire.proto matches the code: {} messages, {} enums", doc.messages.len(), doc.enums.len());
}

#[test]
fn the_readers_see_a_difference() {
    // The checks above cannot pass vacuously: a field renamed, a tag moved or a type changed in
    // the document is reported.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("wire.proto")).expect("wire.proto");
    let code = parse_code(&root.join("src"));
    for (from, to) in [
        ("uint32 top_logprobs = 7;", "uint32 top_log_probs = 7;"),
        ("uint64 nonce = 1;", "uint64 nonce = 2;"),
        ("bytes gguf = 1;", "string gguf = 1;"),
        ("ERROR_KIND_TICKET = 9;", "ERROR_KIND_TICKETS = 9;"),
        ("    Suspect suspect = 23;\n", ""),
    ] {
        assert!(text.contains(from), "the document no longer holds {from:?}");
        let doc = parse_doc(&text.replacen(from, to, 1));
        let wrong = differences("message", &doc.messages, &code.messages).len() + differences("enum", &doc.enums, &code.enums).len();
        assert!(wrong > 0, "{from:?} → {to:?} went unnoticed");
    }
    let comment = "  // Echoed in the `pong`.\n";
    assert!(text.contains(comment), "the document no longer holds {comment:?}");
    let uncommented = text.replacen(comment, "", 1);
    assert!(std::panic::catch_unwind(|| parse_doc(&uncommented)).is_err(), "a field without a comment went unnoticed");
}
