//! Persistent batch slots, handed out lowest-free-first from `0..limit`.

/// A bitset of slots in use. It grows on demand (slots are taken lowest first, so it
/// never spans more words than the busiest moment needed), so a large `max_batch_size`
/// costs nothing up front.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct BatchSlots {
    used: Vec<u64>,
    limit: u32,
    in_use: u32,
    /// No word below this one has a free bit.
    first_maybe_free_word: usize,
}

impl BatchSlots {
    pub fn new(limit: u32) -> Self {
        Self {
            used: Vec::new(),
            limit,
            in_use: 0,
            first_maybe_free_word: 0,
        }
    }

    pub fn free_count(&self) -> u32 {
        self.limit - self.in_use
    }

    /// Takes the lowest free slot; `None` if all `limit` are in use.
    pub fn take_lowest(&mut self) -> Option<u32> {
        if self.in_use == self.limit {
            return None;
        }
        let mut word = self.first_maybe_free_word;
        while word < self.used.len() && self.used[word] == u64::MAX {
            word += 1;
        }
        if word == self.used.len() {
            self.used.push(0);
        }
        let bit = self.used[word].trailing_ones();
        #[expect(
            clippy::cast_possible_truncation,
            reason = "the bitset never spans a word past the limit, a u32"
        )]
        let slot = word as u32 * 64 + bit;
        debug_assert!(slot < self.limit);
        self.used[word] |= 1 << bit;
        self.in_use += 1;
        self.first_maybe_free_word = word;
        Some(slot)
    }

    /// Takes a given slot, which must be free (restoring a slot on revert).
    pub fn take(&mut self, slot: u32) {
        let word = (slot / 64) as usize;
        if word >= self.used.len() {
            self.used.resize(word + 1, 0);
        }
        let mask = 1u64 << (slot % 64);
        debug_assert_eq!(self.used[word] & mask, 0, "slot {slot} is already in use");
        self.used[word] |= mask;
        self.in_use += 1;
    }

    /// Gives a slot back.
    pub fn release(&mut self, slot: u32) {
        let word = (slot / 64) as usize;
        let mask = 1u64 << (slot % 64);
        debug_assert_ne!(self.used[word] & mask, 0, "slot {slot} is not in use");
        self.used[word] &= !mask;
        self.in_use -= 1;
        self.first_maybe_free_word = self.first_maybe_free_word.min(word);
    }
}

/// A batch slot as the int32 a schedule reports (where -1 marks "none yet").
#[expect(
    clippy::cast_possible_wrap,
    reason = "slots are below max_batch_size, at most i32::MAX (`SchedulerConfig::validate`)"
)]
pub(super) fn slot_id(slot: u32) -> i32 {
    debug_assert!(i32::try_from(slot).is_ok());
    slot as i32
}

/// A row of a step's sampled tokens as the int32 a schedule reports.
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    reason = "each sampled row is an entry holding a batch slot, so rows are below max_batch_size <= i32::MAX"
)]
pub(super) fn row_id(row: usize) -> i32 {
    debug_assert!(i32::try_from(row).is_ok());
    row as i32
}

/// A generation entry's position as a journal records it (see `JournalEntry::Decodes`).
#[expect(
    clippy::cast_possible_truncation,
    reason = "each generation entry holds a batch slot, so entries are below max_batch_size <= i32::MAX"
)]
pub(super) fn entry_id(entry: usize) -> u32 {
    debug_assert!(u32::try_from(entry).is_ok());
    entry as u32
}

#[cfg(test)]
mod tests {
    use super::BatchSlots;

    #[test]
    fn lowest_free_first_up_to_the_limit() {
        let mut slots = BatchSlots::new(130);
        let taken: Vec<u32> = (0..130).map(|_| slots.take_lowest().unwrap()).collect();
        assert_eq!(taken, (0..130).collect::<Vec<_>>());
        assert_eq!(slots.take_lowest(), None);
        slots.release(70);
        slots.release(3);
        assert_eq!(slots.free_count(), 2);
        assert_eq!(slots.take_lowest(), Some(3));
        assert_eq!(slots.take_lowest(), Some(70));
        slots.release(129);
        slots.take(129);
        assert_eq!(slots.take_lowest(), None);
    }
}
