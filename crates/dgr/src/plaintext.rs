//! `--insecure-plaintext`: stage links in clear, for debugging on a network one trusts. Both
//! ends of a link must ask for it (each refuses the other mode), and it is said loudly.

#[derive(clap::Args, Clone, Debug)]
pub struct PlaintextArg {
    /// Run this process's stage links (to and between workers) in clear: no encryption and no
    /// check of the workers' keys. Refused unless the other end of each link asks for it too
    #[arg(long)]
    pub insecure_plaintext: bool,
}

impl PlaintextArg {
    /// Sets the process-wide mode before any link is made, and says so.
    pub fn apply(&self, who: &str) {
        if self.insecure_plaintext {
            dgr_proto::set_insecure_plaintext(true);
            eprintln!(
                "dgr {who}: WARNING: --insecure-plaintext: stage links are NOT encrypted or authenticated; anyone on the path can read and alter prompts, tokens and hidden states"
            );
        }
    }
}
