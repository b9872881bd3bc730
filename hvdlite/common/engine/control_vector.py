"""The control vector: what each rank brings to a cycle's MIN-allreduce, in O(1) of the job size.

Every field is combined by MIN, so each one is chosen so that the MIN answers a question
about all ranks at once.  Layout (int32)::

    NEED                     0 if this rank needs a full negotiation (else 1)
    LEN                      minus the length of this rank's request payload
    STALL                    rank 0's stall verdict, an age in cycles (others: INT_MAX)
    PVER  PARAMS[W]          rank 0's live-parameters version and values (others: INT_MAX)
    DUMP  DUMP_AGE           rank 0's request for stacks: its id, and an age in cycles
                             (-1: every rank)
    LEAVING                  lowest rank shutting down (INT_MAX: none)
    AGE_MIN  AGE_MAX_NEG  AGE_WHO      the straggler summary (stragglers.py)
    DIG1  DIG1_NEG  DIG2  DIG2_NEG     digest of the request payload, and its negation
    WAITED_NEG               minus how long the oldest request to negotiate has waited (µs)
    BITS[words]  BITS_NEG[words]       response-cache hits, 31 slots per word, and negations

Why each is enough:

* a rank's negated value's MIN is minus the MAX, so a field and its negation give the
  smallest and the largest value of all ranks;
* the cache bits: where every rank sent the same word, that word is the AND of all ranks'
  hits.  A word whose smallest and largest value differ ("ragged": the ranks hit different
  slots of it) needs a second, small MIN-allreduce of its 31 bits unpacked; every rank sees
  the same ragged words, so every rank runs that second round or none does;
* the digests: when the smallest and largest agree, every rank is asking for exactly the
  same requests, and a negotiation needs no allgather (:meth:`Controller.ingest_uniform`);
* the wait: its MIN is minus the longest any rank's oldest request has waited, so every rank
  decides alike whether lists that differ get a little longer to become the same;
* the ready ages: the smallest and largest age, and ``age_units * size + rank``, whose MIN
  names the rank that became ready last (the one with the smallest age, ties to the lowest).

At 1,024 ranks and the default 1,024-slot cache that is 88 ints (352 bytes), against
``4 * (11 + 2 * size + capacity)`` bytes when every rank had an entry and every slot an int.
"""

import hashlib
from typing import List, Optional, Tuple

import numpy as np

from hvdlite.common.engine.parameters import Parameters
from hvdlite.common.diagnostics.stragglers import NOT_PENDING

INT_MAX = np.iinfo(np.int32).max
#: cache slots per int32 word (the sign bit stays clear, so negation never overflows)
BITS_PER_WORD = 31
#: the unit of the straggler summary's rank-naming field (its exact ages travel in µs)
AGE_UNIT_US = 100

NEED, LEN, STALL, PVER, DUMP, DUMP_AGE, PARAMS = 0, 1, 2, 3, 4, 5, 6
LEAVING = PARAMS + Parameters.WIDTH
AGE_MIN, AGE_MAX_NEG, AGE_WHO = LEAVING + 1, LEAVING + 2, LEAVING + 3
DIG1, DIG1_NEG, DIG2, DIG2_NEG = AGE_WHO + 1, AGE_WHO + 2, AGE_WHO + 3, AGE_WHO + 4
WAITED_NEG = DIG2_NEG + 1
BITS = WAITED_NEG + 1

_SHIFTS = np.arange(BITS_PER_WORD, dtype=np.int64)


def words_for(capacity: int) -> int:
    """How many int32 words carry ``capacity`` cache slots."""
    return -(-capacity // BITS_PER_WORD)


def length(capacity: int) -> int:
    """Ints in the vector (independent of the number of ranks)."""
    return BITS + 2 * words_for(capacity)


def template(capacity: int) -> np.ndarray:
    """The vector of a rank that has nothing to say (every field neutral under MIN)."""
    vec = np.zeros(length(capacity), dtype=np.int32)
    vec[NEED] = 1
    vec[STALL:LEAVING] = INT_MAX
    vec[LEAVING] = INT_MAX
    vec[AGE_MIN] = NOT_PENDING
    vec[AGE_MAX_NEG] = -NOT_PENDING
    vec[AGE_WHO] = INT_MAX
    vec[DIG1] = vec[DIG2] = -1  # "no payload": never uniform
    vec[DIG1_NEG] = vec[DIG2_NEG] = -INT_MAX
    return vec


# -- cache bits ---------------------------------------------------------------------------
def put_slots(vec: np.ndarray, slots: List[int], words: int) -> None:
    """Set this rank's hit bits (and their negations)."""
    packed = np.zeros(words, dtype=np.int64)
    idx = np.asarray(slots, dtype=np.int64)
    np.bitwise_or.at(packed, idx // BITS_PER_WORD, np.left_shift(1, idx % BITS_PER_WORD))
    vec[BITS : BITS + words] = packed
    vec[BITS + words : BITS + 2 * words] = -packed


def ragged_words(agreed: np.ndarray, words: int) -> np.ndarray:
    """Indices of the words in which the ranks' hits differ (the same on every rank)."""
    low = agreed[BITS : BITS + words]
    high = -agreed[BITS + words : BITS + 2 * words]
    return np.flatnonzero(low != high)


def own_bits(slots: List[int], word_ids: np.ndarray) -> np.ndarray:
    """This rank's hits in ``word_ids``, one int32 per slot (the second round's vector)."""
    bits = np.zeros((len(word_ids), BITS_PER_WORD), dtype=np.int32)
    where = {int(w): i for i, w in enumerate(word_ids)}
    for s in slots:
        i = where.get(s // BITS_PER_WORD)
        if i is not None:
            bits[i, s % BITS_PER_WORD] = 1
    return bits.ravel()


def ready_slots(
    agreed: np.ndarray, words: int, ragged: np.ndarray, second: Optional[np.ndarray]
) -> List[int]:
    """The slots every rank hit: the agreed words, with the ragged ones replaced by the
    second round's MIN of their unpacked bits."""
    packed = agreed[BITS : BITS + words].astype(np.int64)
    if len(ragged):
        packed[ragged] = 0
    ready = np.flatnonzero(((packed[:, None] >> _SHIFTS) & 1).ravel())
    if len(ragged):
        extra = np.flatnonzero(second.reshape(len(ragged), BITS_PER_WORD))
        rows, cols = np.divmod(extra, BITS_PER_WORD)
        ready = np.sort(np.concatenate([ready, ragged[rows] * BITS_PER_WORD + cols]))
    return ready.tolist()


# -- request digest (uniform negotiation) -------------------------------------------------
def put_digest(vec: np.ndarray, payload: bytes) -> None:
    """Two 31-bit halves of a 62-bit digest of this rank's request payload, and negations."""
    h = hashlib.blake2b(payload, digest_size=8).digest()
    d1 = int.from_bytes(h[:4], "little") & 0x3FFFFFFF
    d2 = int.from_bytes(h[4:], "little") & 0x3FFFFFFF
    vec[DIG1], vec[DIG1_NEG], vec[DIG2], vec[DIG2_NEG] = d1, -d1, d2, -d2


def put_waited(vec: np.ndarray, waited_us: int) -> None:
    """How long this rank's oldest request to negotiate has waited (INT_MAX: do not wait)."""
    vec[WAITED_NEG] = -min(max(waited_us, 0), INT_MAX)


def longest_wait_us(agreed: np.ndarray) -> int:
    """The longest any rank's oldest request to negotiate has waited (µs)."""
    return -int(agreed[WAITED_NEG])


def uniform(agreed: np.ndarray) -> bool:
    """Whether every rank sent a payload with the same digest (the same requests)."""
    return bool(
        agreed[DIG1] >= 0
        and agreed[DIG1] == -agreed[DIG1_NEG]
        and agreed[DIG2] == -agreed[DIG2_NEG]
    )


# -- straggler summary --------------------------------------------------------------------
def put_age(vec: np.ndarray, age_us: int, rank: int, size: int) -> None:
    """This rank's ready age (µs, or NOT_PENDING) in the three summary fields."""
    vec[AGE_MIN] = age_us
    vec[AGE_MAX_NEG] = -age_us
    if age_us < NOT_PENDING:
        units = min(age_us // AGE_UNIT_US, INT_MAX // size - 1)
        vec[AGE_WHO] = units * size + rank
    else:
        vec[AGE_WHO] = INT_MAX


def read_ages(agreed: np.ndarray, size: int) -> Tuple[int, int, int]:
    """``(newest rank, smallest age, largest age)`` of the agreed vector (µs)."""
    return int(agreed[AGE_WHO]) % size, int(agreed[AGE_MIN]), -int(agreed[AGE_MAX_NEG])
