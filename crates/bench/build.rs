// Embeds the commit dgr was built from, for benchmark records: `-dirty` after it when tracked
// files differ from it, so a record of an uncommitted build does not name a commit it was not.
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let o = Command::new("git").args(args).output().ok().filter(|o| o.status.success())?;
    Some(String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn main() {
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    println!("cargo:rustc-env=DGR_COMMIT={commit}{}", if dirty { "-dirty" } else { "" });
    // Where HEAD and the refs live: `.git/` in a checkout, split between the worktree's own
    // directory and the common one in a `git worktree` (where `.git` is a file). A path that
    // does not exist would rerun this script on every build, so only existing ones are named.
    for name in ["HEAD", "refs", "packed-refs", "index"] {
        if let Some(path) = git(&["rev-parse", "--git-path", name]).filter(|p| std::path::Path::new(p).exists()) {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    // And the sources whose edits make a build dirty (a directory is scanned whole).
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for name in ["crates", "Cargo.toml", "Cargo.lock"] {
        let path = root.join(name);
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
}
