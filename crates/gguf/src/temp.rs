//! Files written whole or not at all: written under a temporary name beside the target, then
//! renamed over it, so a reader never sees a half-written file.

use crate::error::GgufError;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Runs `write` on a fresh temporary file beside `path` (same directory, so the rename stays on
/// one file system), then renames it to `path`. On any error the temporary file is removed and
/// `path` is untouched.
pub(crate) fn write_atomically(path: &Path, write: impl FnOnce(&mut File) -> Result<(), GgufError>) -> Result<(), GgufError> {
    // Process id and a counter: unique across concurrent processes and threads.
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".tmp-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
    let tmp = PathBuf::from(name);
    let io = |source| GgufError::Io { path: tmp.clone(), source };
    // `create_new` refuses an existing file or link there rather than write through it.
    let mut file = OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(io)?;
    let done = write(&mut file).and_then(|()| std::fs::rename(&tmp, path).map_err(io));
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done
}
