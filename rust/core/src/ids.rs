//! The ids every layer names things by, and their conversions: a request's id, a
//! superblock's id (also its physical page id on every rank) and the int32 page ids the
//! executor's arrays hold. A leaf: it imports nothing of the crate, so the ledger, the
//! prefix cache, the layout and the scheduler all depend on it and on nothing above it.

/// A request's id, chosen by the caller; unique among live requests.
pub type RequestId = u64;
/// A superblock id; it is also the physical page id on every rank.
pub type SuperblockId = u32;

/// Largest pool: superblock ids are page ids, handed out as int32 (block tables pad with
/// -1), so every id must fit `i32`.
pub const MAX_CAPACITY: u32 = i32::MAX as u32;

/// A superblock id as the int32 page id of block tables and the executor's arrays.
#[expect(
    clippy::cast_possible_wrap,
    reason = "ids are below the pool's capacity, at most MAX_CAPACITY = i32::MAX (`Ledger::new` refuses more)"
)]
#[inline]
pub fn page_id(superblock: SuperblockId) -> i32 {
    debug_assert!(superblock < MAX_CAPACITY);
    superblock as i32
}

/// The length of a page table or of the free list, in superblocks.
#[expect(
    clippy::cast_possible_truncation,
    reason = "a table or the free list holds at most the pool's capacity, a u32"
)]
#[inline]
pub fn superblock_count(len: usize) -> u32 {
    len as u32
}
