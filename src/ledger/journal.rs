//! The sled ledger's journal: what makes a round durable.
//!
//! A round's changes (the records it writes or removes, and the clock's
//! high-water mark) are encoded as one journal record, written with one
//! `pwrite` into a preallocated, zero-filled file, and `fdatasync`ed before
//! the round answers; only then are they applied to sled, which is not
//! flushed per round. So a durable round costs one write and one
//! `fdatasync` of a file whose size never changes, instead of sled's flush
//! (which hands its log write to sled's own thread pool and waits for it)
//! followed by an `fdatasync` (docs/performance.md, "MCP round trip").
//!
//! The file: a header block (magic, epoch, CRC-32 of both) at offset 0,
//! then records from [`START`]: length, CRC-32 of what follows it, epoch,
//! sequence number, and the changes. Replay (at every start) applies, in
//! order, the records of the header's epoch with consecutive sequence
//! numbers and a good CRC, and stops at the first that is not one: a
//! record torn by a crash was never acknowledged (its round answers only
//! after the `fdatasync`), and records of earlier epochs are stale.
//!
//! A checkpoint makes sled durable on its own (its flush, then an
//! `fdatasync` of its data file) and only then writes the next epoch into
//! the header and `fdatasync`s it: every record of the old epoch is in
//! sled's file by then, so none is needed again. A checkpoint runs at
//! start after replay, when the next round's record would not fit, at
//! least every five seconds while rounds come, and after a round too large for
//! the journal (written straight into sled).
//! Replaying a record again is harmless: each change sets a key to a value
//! or removes it, in the order the writer decided them.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::LedgerError;

/// In the ledger directory, beside sled's files.
pub(super) const FILE: &str = "stateseal-journal";
/// The file's size, allocated (written with zeros) when it is created.
const SIZE: u64 = 8 << 20;
/// Where records begin; the header block is before it.
const START: u64 = 4096;
const MAGIC: &[u8; 8] = b"SSJRNL01";
/// Length (4), CRC-32 (4), epoch (8), sequence number (8).
const HEAD: usize = 24;

/// The sled tree a change is to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tree {
    Records = 0,
    Meta = 1,
}

/// One change of a round: `key` in `tree` set to `value`, or removed.
pub(super) struct Change<'a> {
    pub tree: Tree,
    pub key: &'a [u8],
    pub value: Option<&'a [u8]>,
}

pub(super) struct Journal {
    file: File,
    epoch: u64,
    /// The next record's sequence number in this epoch.
    seq: u64,
    /// Where the next record goes.
    at: u64,
    buf: Vec<u8>,
}

fn header(epoch: u64) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[..8].copy_from_slice(MAGIC);
    h[8..16].copy_from_slice(&epoch.to_be_bytes());
    let crc = crc32fast::hash(&h[..16]);
    h[16..].copy_from_slice(&crc.to_be_bytes());
    h
}

fn be32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_be_bytes(a)
}

fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

impl Journal {
    /// Opens the journal in `dir` (creating it, empty, when there is none:
    /// a new ledger, or one written before the journal, whose every round
    /// was flushed into sled) and hands each change of its current epoch,
    /// in order, to `apply`. Returns the journal and how many records were
    /// replayed; the caller makes them durable in sled and then calls
    /// [`Journal::rotate`].
    pub fn open(
        dir: &Path,
        mut apply: impl FnMut(Change<'_>) -> Result<(), LedgerError>,
    ) -> Result<(Self, usize), LedgerError> {
        let path = dir.join(FILE);
        // Only a journal known to be absent is created: any other failure
        // to look (an I/O error, a permission) must not replace one.
        if !path
            .try_exists()
            .map_err(|e| LedgerError::storage("look for the ledger journal", e))?
        {
            return Ok((Self::create(dir)?, 0));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| LedgerError::storage("open the ledger journal", e))?;
        let mut all = vec![0u8; SIZE as usize];
        let len = file
            .metadata()
            .map_err(|e| LedgerError::storage("read the ledger journal", e))?
            .len();
        if len != SIZE {
            return Err(LedgerError::Corrupt("ledger journal of the wrong size"));
        }
        file.read_exact_at(&mut all, 0)
            .map_err(|e| LedgerError::storage("read the ledger journal", e))?;
        let h = &all[..20];
        if &h[..8] != MAGIC || be32(&h[16..]) != crc32fast::hash(&h[..16]) {
            return Err(LedgerError::Corrupt("ledger journal header"));
        }
        let epoch = be64(&h[8..16]);
        let (mut at, mut seq) = (START as usize, 0u64);
        while let Some(head) = all.get(at..at + HEAD) {
            // What follows the length and the CRC: epoch, sequence, changes.
            let len = be32(head) as usize;
            let Some(body) = all.get(at + 8..at + 8 + len) else {
                break;
            };
            if len < HEAD - 8
                || be64(&head[8..16]) != epoch
                || be64(&head[16..24]) != seq
                || be32(&head[4..8]) != crc32fast::hash(body)
            {
                break;
            }
            decode(&body[16..], &mut apply)?;
            at += 8 + len;
            seq += 1;
        }
        let journal = Journal {
            file,
            epoch,
            seq,
            at: at as u64,
            buf: Vec::new(),
        };
        Ok((journal, seq as usize))
    }

    /// A new, empty journal at epoch 1: written in full under a temporary
    /// name, synced, then renamed into place and the directory synced.
    fn create(dir: &Path) -> Result<Self, LedgerError> {
        let tmp = dir.join(format!("{FILE}.new"));
        let storage = |step| move |e| LedgerError::storage(step, e);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(storage("create the ledger journal"))?;
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..SIZE / zeros.len() as u64 {
            file.write_all(&zeros)
                .map_err(storage("allocate the ledger journal"))?;
        }
        file.write_all_at(&header(1), 0)
            .map_err(storage("write the ledger journal header"))?;
        file.sync_all()
            .map_err(storage("sync the new ledger journal"))?;
        std::fs::rename(&tmp, dir.join(FILE)).map_err(storage("install the ledger journal"))?;
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(storage("sync the ledger directory"))?;
        Ok(Journal {
            file,
            epoch: 1,
            seq: 0,
            at: START,
            buf: Vec::new(),
        })
    }

    /// Encodes `changes` as the next record. `None` when it would not fit
    /// in what is left of this epoch (checkpoint, then encode again), and
    /// `Some(false)` when it would not fit even in an empty journal.
    pub fn encode(&mut self, changes: &[Change<'_>]) -> Option<bool> {
        self.buf.clear();
        self.buf.extend_from_slice(&[0u8; 8]);
        self.buf.extend_from_slice(&self.epoch.to_be_bytes());
        self.buf.extend_from_slice(&self.seq.to_be_bytes());
        for c in changes {
            let value = c.value.unwrap_or_default();
            self.buf.push(c.tree as u8);
            self.buf.push(u8::from(c.value.is_some()));
            self.buf
                .extend_from_slice(&(c.key.len() as u16).to_be_bytes());
            self.buf.extend_from_slice(c.key);
            self.buf
                .extend_from_slice(&(value.len() as u16).to_be_bytes());
            self.buf.extend_from_slice(value);
        }
        let len = (self.buf.len() - 8) as u32;
        let crc = crc32fast::hash(&self.buf[8..]);
        self.buf[..4].copy_from_slice(&len.to_be_bytes());
        self.buf[4..8].copy_from_slice(&crc.to_be_bytes());
        if START + self.buf.len() as u64 > SIZE {
            Some(false)
        } else if self.at + self.buf.len() as u64 > SIZE {
            None
        } else {
            Some(true)
        }
    }

    /// Writes the record [`Journal::encode`] made and `fdatasync`s it.
    pub fn write(&mut self) -> Result<(), LedgerError> {
        self.file
            .write_all_at(&self.buf, self.at)
            .map_err(|e| LedgerError::storage("journal write", e))?;
        self.file
            .sync_data()
            .map_err(|e| LedgerError::storage("journal fdatasync", e))?;
        self.at += self.buf.len() as u64;
        self.seq += 1;
        Ok(())
    }

    /// Starts the next epoch. Only once every change of this epoch is
    /// durable in sled: the records before this point are never read again.
    pub fn rotate(&mut self) -> Result<(), LedgerError> {
        self.file
            .write_all_at(&header(self.epoch + 1), 0)
            .map_err(|e| LedgerError::storage("journal header write", e))?;
        self.file
            .sync_data()
            .map_err(|e| LedgerError::storage("journal header fdatasync", e))?;
        self.epoch += 1;
        self.seq = 0;
        self.at = START;
        Ok(())
    }
}

/// Hands each change of a record's body to `apply`. A body whose CRC
/// matched but does not parse was written by something else: corrupt.
fn decode(
    mut body: &[u8],
    apply: &mut impl FnMut(Change<'_>) -> Result<(), LedgerError>,
) -> Result<(), LedgerError> {
    const BAD: LedgerError = LedgerError::Corrupt("ledger journal record");
    while !body.is_empty() {
        let (&[tree, set, k0, k1], rest) = body.split_first_chunk::<4>().ok_or(BAD)?;
        let klen = u16::from_be_bytes([k0, k1]) as usize;
        let key = rest.get(..klen).ok_or(BAD)?;
        let rest = &rest[klen..];
        let (&[v0, v1], rest) = rest.split_first_chunk::<2>().ok_or(BAD)?;
        let vlen = u16::from_be_bytes([v0, v1]) as usize;
        let value = rest.get(..vlen).ok_or(BAD)?;
        body = &rest[vlen..];
        let tree = match tree {
            0 => Tree::Records,
            1 => Tree::Meta,
            _ => return Err(BAD),
        };
        let value = match set {
            1 => Some(value),
            0 if vlen == 0 => None,
            _ => return Err(BAD),
        };
        apply(Change { tree, key, value })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    type Seen = Vec<(Tree, Vec<u8>, Option<Vec<u8>>)>;

    fn replay(dir: &Path) -> (Journal, usize, Seen) {
        let mut seen = Vec::new();
        let (j, n) = Journal::open(dir, |c| {
            seen.push((c.tree, c.key.to_vec(), c.value.map(<[u8]>::to_vec)));
            Ok(())
        })
        .unwrap();
        (j, n, seen)
    }

    /// Writes `changes` as the next record (it must fit).
    fn append(j: &mut Journal, changes: &[Change<'_>]) {
        assert_eq!(j.encode(changes), Some(true));
        j.write().unwrap();
    }

    fn put<'a>(key: &'a [u8], value: &'a [u8]) -> Change<'a> {
        Change {
            tree: Tree::Records,
            key,
            value: Some(value),
        }
    }

    #[test]
    fn records_replay_in_order_until_the_epoch_ends() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, n, seen) = replay(dir.path());
        assert_eq!((n, seen.len()), (0, 0));
        append(&mut j, &[put(b"a", b"1"), put(b"b", b"2")]);
        let gone = Change {
            tree: Tree::Records,
            key: b"a",
            value: None,
        };
        let meta = Change {
            tree: Tree::Meta,
            key: b"high_water",
            value: Some(&[7; 8]),
        };
        append(&mut j, &[gone, meta]);
        drop(j);
        let (mut j, n, seen) = replay(dir.path());
        assert_eq!(n, 2);
        assert_eq!(
            seen,
            vec![
                (Tree::Records, b"a".to_vec(), Some(b"1".to_vec())),
                (Tree::Records, b"b".to_vec(), Some(b"2".to_vec())),
                (Tree::Records, b"a".to_vec(), None),
                (Tree::Meta, b"high_water".to_vec(), Some(vec![7; 8])),
            ]
        );
        // After a checkpoint nothing of the old epoch is replayed, though
        // its bytes are still in the file; new records are.
        j.rotate().unwrap();
        append(&mut j, &[put(b"c", b"3")]);
        drop(j);
        let (_, n, seen) = replay(dir.path());
        assert_eq!(n, 1);
        assert_eq!(
            seen,
            vec![(Tree::Records, b"c".to_vec(), Some(b"3".to_vec()))]
        );
    }

    #[test]
    fn a_record_of_an_earlier_epoch_or_out_of_sequence_is_not_replayed() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = replay(dir.path());
        append(&mut j, &[put(b"a", b"1")]);
        append(&mut j, &[put(b"b", b"2")]);
        j.rotate().unwrap();
        // As long as the first old record: the second old one (sequence 1,
        // a good CRC, the old epoch) lies right after it.
        append(&mut j, &[put(b"c", b"3")]);
        drop(j);
        let (mut j, n, seen) = replay(dir.path());
        assert_eq!(n, 1);
        assert_eq!(
            seen,
            vec![(Tree::Records, b"c".to_vec(), Some(b"3".to_vec()))]
        );
        // The current epoch's first record again after its second: a good
        // CRC and epoch, the wrong sequence number.
        j.rotate().unwrap();
        let first = j.at;
        append(&mut j, &[put(b"d", b"4")]);
        let len = j.at - first;
        append(&mut j, &[put(b"e", b"5")]);
        let mut copy = vec![0u8; len as usize];
        j.file.read_exact_at(&mut copy, first).unwrap();
        j.file.write_all_at(&copy, j.at).unwrap();
        drop(j);
        let (_, n, seen) = replay(dir.path());
        assert_eq!(n, 2);
        assert_eq!(seen.len(), 2);
    }

    #[test]
    fn an_empty_record_replays_and_a_length_too_short_ends_the_replay() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = replay(dir.path());
        append(&mut j, &[]);
        append(&mut j, &[put(b"a", b"1")]);
        // A record claiming 8 bytes after its CRC, which is their CRC, in
        // the right epoch and sequence: shorter than any record can be.
        let mut short = Vec::new();
        short.extend_from_slice(&8u32.to_be_bytes());
        short.extend_from_slice(&crc32fast::hash(&j.epoch.to_be_bytes()).to_be_bytes());
        short.extend_from_slice(&j.epoch.to_be_bytes());
        short.extend_from_slice(&j.seq.to_be_bytes());
        j.file.write_all_at(&short, j.at).unwrap();
        drop(j);
        let (_, n, seen) = replay(dir.path());
        assert_eq!(n, 2);
        assert_eq!(
            seen,
            vec![(Tree::Records, b"a".to_vec(), Some(b"1".to_vec()))]
        );
    }

    #[test]
    fn a_removal_carrying_a_value_is_corrupt_though_its_crc_is_good() {
        let dir = tempfile::tempdir().unwrap();
        let (j, _, _) = replay(dir.path());
        // The encoder writes a removal with no value; this one has one.
        let mut body = Vec::new();
        body.extend_from_slice(&j.epoch.to_be_bytes());
        body.extend_from_slice(&j.seq.to_be_bytes());
        body.extend_from_slice(&[0, 0, 0, 1, b'a', 0, 1, b'x']);
        let mut record = (body.len() as u32).to_be_bytes().to_vec();
        record.extend_from_slice(&crc32fast::hash(&body).to_be_bytes());
        record.extend_from_slice(&body);
        j.file.write_all_at(&record, j.at).unwrap();
        drop(j);
        let e = Journal::open(dir.path(), |_| Ok(())).err().unwrap();
        assert!(
            matches!(e, LedgerError::Corrupt("ledger journal record")),
            "{e:?}"
        );
    }

    #[test]
    fn a_torn_record_ends_the_replay_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = replay(dir.path());
        append(&mut j, &[put(b"a", b"1")]);
        let second = j.at;
        append(&mut j, &[put(b"b", b"2")]);
        append(&mut j, &[put(b"c", b"3")]);
        drop(j);
        // One byte of the second record's value flipped: it and every
        // record after it are not replayed.
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.path().join(FILE))
            .unwrap();
        let end = second + HEAD as u64 + 4 + 1 + 2;
        f.write_all_at(b"X", end).unwrap();
        let (_, n, seen) = replay(dir.path());
        assert_eq!(n, 1);
        assert_eq!(
            seen,
            vec![(Tree::Records, b"a".to_vec(), Some(b"1".to_vec()))]
        );
    }

    #[test]
    fn a_full_epoch_asks_for_a_checkpoint_and_a_round_larger_than_the_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = replay(dir.path());
        let value = vec![9u8; 60_000];
        let mut written = 0;
        while j.encode(&[put(b"k", &value)]) == Some(true) {
            j.write().unwrap();
            written += 1;
        }
        assert_eq!(j.encode(&[put(b"k", &value)]), None);
        assert_eq!(
            written,
            ((SIZE - START) / (HEAD as u64 + 6 + 1 + 60_000)) as usize
        );
        // Every one of them replays, up to the end of the file.
        drop(j);
        let (mut j, n, seen) = replay(dir.path());
        assert_eq!((n, seen.len()), (written, written));
        j.rotate().unwrap();
        assert_eq!(j.encode(&[put(b"k", &value)]), Some(true));
        let many: Vec<_> = (0..150).map(|_| put(b"k", &value)).collect();
        assert_eq!(j.encode(&many), Some(false));
    }

    #[test]
    fn a_damaged_header_or_size_is_refused_not_ignored() {
        let dir = tempfile::tempdir().unwrap();
        drop(replay(dir.path()));
        let path = dir.path().join(FILE);
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&[0xff], 9).unwrap();
        let e = Journal::open(dir.path(), |_| Ok(())).err().unwrap();
        assert!(
            matches!(e, LedgerError::Corrupt("ledger journal header")),
            "{e:?}"
        );
        f.set_len(SIZE - 1).unwrap();
        let e = Journal::open(dir.path(), |_| Ok(())).err().unwrap();
        assert!(
            matches!(e, LedgerError::Corrupt("ledger journal of the wrong size")),
            "{e:?}"
        );
    }
}
