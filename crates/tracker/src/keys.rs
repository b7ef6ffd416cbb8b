//! The signing key set trackers sharing one database share: each signs route tickets with the
//! set's current key and tells every connecting worker all of the set's public keys, so a
//! worker accepts a ticket from any tracker of the swarm.

use dgr_proto::{key_id, sign_ticket, SignedTicket, SigningKey, Ticket, TrackerKey};

pub(crate) struct KeySet {
    current: SigningKey,
    /// Every key of the set, the current one included, as a `Challenge` carries them.
    public: Vec<TrackerKey>,
}

impl KeySet {
    /// The set from the store's keys, the current one first.
    pub fn new(current: SigningKey, others: &[SigningKey]) -> KeySet {
        let public = std::iter::once(&current)
            .chain(others)
            .map(|k| TrackerKey { key_id: key_id(&k.verifying_key()), public_key: k.verifying_key().to_bytes().to_vec() })
            .collect();
        KeySet { current, public }
    }

    /// Signs `t`, which names the current key (`current_id`), with that key.
    pub fn sign(&self, t: &Ticket) -> SignedTicket {
        sign_ticket(t, &self.current)
    }

    pub fn public(&self) -> &[TrackerKey] {
        &self.public
    }

    pub fn current_id(&self) -> u64 {
        self.public[0].key_id
    }
}
