"""The router's live view of the WAN line: goodput, RTT, the KV backlog, P's throughput.

One module for the live router and the simulator (which holds one per line too), so
the simulator's estimate is the router's estimate. Pure state: no I/O, no clock of its
own (every call that needs the time takes ``now``).

What it keeps, and where each number comes from:

- **Backlog**: the bytes (and transfers) of KV the router itself committed to the line
  and has not seen land: ``commit`` at dispatch, ``landed`` when MD streams (it has the
  KV), ``settle`` when the transfer failed or the request ended first (and where the
  simulator's KV lands: its line runs at exactly the declared rate, nothing to learn).
  A new transfer queues behind it (``cost_model.wan_transfer_seconds``).
- **Awaited KV**: each committed transfer also names its MD and the prompt blocks it
  carries there. A later request whose hit on that MD counts on any of them (the
  conversation's next turn, sent while the last turn's KV still crosses) gets its
  first token from MD only once all of that transfer landed, so its estimate waits
  for the whole transfer, not for the fair share of the line its own few bytes would
  get (``awaited_bytes``). Bookkeeping, like the backlog: the static view counts it too.
- **Goodput**: the declared rate is the prior; each transfer that lands is a sample,
  from the router's own bookkeeping: the seconds from dispatch to MD's first token,
  less one RTT and the fixed costs, is what the line took for the transfer's bytes
  (P streams the KV while it prefills, so the line's time overlaps the prefill's;
  where that time is no longer than P's estimated prefill, the prefill may have paced
  the transfer and the time only bounds the line's from above). A small transfer
  (below) is the last prefill chunk's KV, sent after the prefill: its time is
  counted less the prefill. Where another transfer arrived after this one was dispatched,
  this one queued behind it, and the line took at most the time between the two
  arrivals (an arrival is the first the router heard of a transfer's KV crossing:
  P's report, relayed or not, or MD's first token; both lag the line alike, so the
  lag cancels): the sample is the smaller of the two. Queueing is thus measured, not
  guessed from the backlog (a commitment leaves the backlog only when its report
  comes back, well after its bytes crossed; counted as still queued, it read the
  line 2-3x faster than it was in a benchmark's throttle; and a wait behind a relayed
  transfer not counted as queueing read it many times slower under load). Other
  router replicas' backlog, whose arrivals this estimator does not see, still counts
  whole. Samples
  are averaged as seconds per byte (an EWMA, gain ``GAIN``): a collapse shows after
  a few transfers, and a recovery too, because relayed requests still ship their KV
  and keep sampling.
- **Fixed costs**: a transfer too small to show the line (its expected serialization
  under ``MIN_SAMPLE_S`` at the current estimate) is no goodput sample; what its time
  holds beyond the prefill, one RTT and that serialization is the P-MD path's fixed
  cost (MD's step, P's queue beyond the estimate), averaged the same way and taken
  out of the goodput samples, so the line is not charged for it. Unless it took
  ``MIN_SAMPLE_S`` longer than that fixed cost and its serialization allow, having had
  the line to itself (nothing else committed from its dispatch to its landing: a large
  transfer beside it slows it without the line being slow): then the line is slower
  than believed, and the small transfer is a goodput sample after all (once its bytes
  are worth timing, at least a tenth of ``MIN_SAMPLE_S`` at the estimate, and no
  slower than ``MAX_SLOWDOWN`` times the estimate, so that one stall of MD's step does
  not teach a collapse). Without this a line throttled while the
  decode-side cache keeps misses small was never learnt: a benchmark's whole 60 s
  10x throttle passed at the declared rate, its 30-60-token transfers each 80-180 ms
  late. Only a transfer that
  queued behind none samples it: a queue is the line's, not a fixed cost. A relayed
  transfer's first token from MD also waits for the hand-off, whose token IDs cross
  the line once more: one more RTT comes off its sample. Even so, the hand-off waits
  for the relay's step loop too, so such a time only bounds the line's from above
  (``upper_bound``): it may show the line faster than believed, never slower.
- **P's timing** (``shipped``): P reports on its stream when MD imported the KV, with
  the seconds from its first chunk on the line to MD's "imported" (``KVShipment``).
  That time holds no prefill, no P queue and no hand-off; less one RTT (the chunks
  one way, the answer back) it is the line's, plus P's engine exporting each chunk
  and MD's engine importing it. On a CPU-starved machine those waits are long (a
  benchmark at load average 25 learnt the line 10x slower than it was from them), so
  this time too only bounds the line's from above: it shows a line faster than
  believed (a recovery, while the router relays and MD has not streamed yet), never
  slower, and never faster than declared. It comes for relayed transfers too, before
  their hand-off. Only the transfer's own bytes count: the backlog it was committed
  behind may have crossed before P's first chunk (counted, it made the line look 2x
  faster than declared in a benchmark). P's report takes the transfer off the
  backlog, but MD's first token, usually a moment later, still times it from the
  router's side: that time can show a slower line, P's cannot (when P's report took
  the transfer whole, a throttled line was learnt from only the few transfers whose
  first token beat P's report).
- **Transfers still crossing** (``overdue``): every sample above waits for a landing,
  and on a line throttled under load the landings lag the throttle by the transfers
  themselves (a benchmark's 10x throttle went unseen for 40 s: every landing came
  right after another, so each was timed as a short queue, while transfers took 1-7 s
  and then stalled). A transfer not yet landed bounds the line from below without
  waiting: since its dispatch the line can have carried no more than what was queued
  ahead of it and everything committed since (its own bytes included), and a line that
  carried all that would have landed it. So where the oldest transfer still crossing
  is ``MIN_OVERDUE_S`` beyond what the estimate allows (P's prefill, one RTT, the
  fixed cost, that many bytes), its time divided by those bytes is a slower line than
  believed, and the estimate moves towards it by the gain at each decision, until the
  transfer is no longer that late at the estimate. Only slower, and only the oldest
  transfer (one look per decision, whatever the fleet). A starved P or MD makes a
  transfer late too; the margin keeps ordinary jitter out. Other router replicas'
  commitments are counted as their backlog now (a shared store's sum): those that
  landed since this transfer's dispatch are not seen, so with several replicas the
  bound can be stricter than the line, as it can where P or MD is starved.
- **RTT**: the declared value. The router has no round trip of its own on the line;
  the sampled goodput absorbs extra delay on top of it.
- **Prefill throughput per P instance**: the configured rate is the prior; a request
  with a relay samples it (P's miss over the seconds from dispatch to the relay's
  first token: P's queue included, which is what the TTFT estimate needs). Those
  seconds also hold a fixed cost (the hop to the relay, its first step, the HTTP
  calls): prefills under ``MIN_PREFILL_SAMPLE_TOKENS`` measure it per P, and it comes
  off the larger ones' samples, so a small miss does not read as a slow P.
  Only a request dispatched to an idle relay samples P: on a busy relay those seconds
  also hold the relay's own queue, which is not P's and which the relay's estimate
  carries instead (next item). Without that split, a loaded relay reads as a slow P,
  every P-MD estimate grows, more requests relay, and the relay loads further.
- **The relay's queue**: the seconds each request already on the relay adds to a new
  relayed request's first token, sampled from the requests dispatched to a busy relay
  (their time beyond P's estimated prefill, per request ahead of them). The policy
  charges it to P-RLD-MD (``relay_slot_s`` x the relay's active requests) and relays
  only where that is less than the transfer the relay hides.

``frozen`` keeps the view at the declared values (``--static-link-view``): the backlog
is still counted (the router's own bookkeeping, not a measurement), nothing is learnt.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

from pdd.common.cost_model import LinkState, queued_ahead_bytes

#: Weight of a new sample in the running averages: about the last 4-8 transfers count,
#: so a 10x collapse is seen within a few transfers and one odd sample moves it little.
GAIN = 0.25
#: A transfer whose serialization the current estimate puts under this is no goodput
#: sample: the router's timing of it is prefill, MD's step and scheduling, not the line.
MIN_SAMPLE_S = 0.02
#: The fastest a sample may put the line, as a multiple of the declared rate.
MAX_OVER_DECLARED = 4.0
#: The slowest a small transfer's sample may put the line, as a multiple of the estimate.
MAX_SLOWDOWN = 10.0
#: Small transfers' fixed-cost samples needed before one can show a slow line.
MIN_FIXED_SAMPLES = 4
#: A transfer still crossing shows a slower line only this late beyond the estimate.
MIN_OVERDUE_S = 0.5
#: A prefill under this many tokens is no throughput sample (fixed costs dominate it).
MIN_PREFILL_SAMPLE_TOKENS = 64
_GIGA = 1e9
_BITS_PER_BYTE = 8


@dataclass(frozen=True)
class Backlog:
    """KV committed to the line and not yet landed."""

    bytes: int = 0
    transfers: int = 0


@dataclass(frozen=True)
class Transfer:
    """One KV transfer the router committed to the line (``LinkEstimator.commit``)."""

    nbytes: int
    prefill_id: str
    #: The tokens P computes first (its miss), to take P's time out of the sample.
    prefill_tokens: int
    committed_at: float
    #: Other router replicas' bytes the transfer was expected to queue behind when it
    #: was committed (a shared backlog's share that is not this estimator's own).
    others_ahead_bytes: int
    #: A relay is on the route: MD's first token waits for the hand-off too.
    relayed: bool = False
    #: The MD the KV goes to, and the hashes of the prompt blocks it carries there.
    main_id: str = ""
    carried: frozenset[int] = frozenset()
    #: No other transfer was on the line when this one was committed, and ``serial``
    #: counts the commitments up to this one: with none after it, it had the line alone.
    alone: bool = False
    serial: int = 0
    #: This estimator's bytes already committed and not landed when this one was, and
    #: all its bytes committed before this one (what ``overdue`` counts as offered).
    own_ahead_bytes: int = 0
    committed_before: int = 0


@dataclass(frozen=True)
class Arrival:
    """When the router first heard a transfer's KV had crossed (P's report, or MD's
    first token where that came first), and when it had last heard that of any other
    transfer before it: the line's clock that queueing is measured on."""

    at: float
    previous: float


class LinkEstimator:
    """One WAN line's live view (see the module docstring)."""

    def __init__(self, prior: LinkState, prefill_tokens_per_s: float, frozen: bool = False) -> None:
        if prefill_tokens_per_s <= 0:
            raise ValueError(f"prefill_tokens_per_s must be positive, got {prefill_tokens_per_s}")
        self.prior = prior
        self.frozen = frozen
        self._prefill_prior_spt = 1.0 / prefill_tokens_per_s
        self._spb = _seconds_per_byte(prior.declared_gbps)
        self._prefill_spt: dict[str, float] = {}
        #: Per P: the seconds a prefill takes whatever its size (see the docstring).
        self._prefill_fixed_s: dict[str, float] = {}
        self._own = Backlog()
        self.goodput_samples = 0
        #: The P-MD path's measured fixed cost beyond prefill and one RTT (seconds).
        self.overhead_s = 0.0
        self.overhead_samples = 0
        self._relay_slot_s = 0.0
        #: When the router last heard a transfer's KV had crossed (``Arrival``).
        self._last_arrival_at = float("-inf")
        #: This estimator's commitments not yet settled, by identity.
        self._in_flight: dict[int, Transfer] = {}
        #: Per prompt block, the transfers crossing that carry it (by identity): what
        #: ``awaited_bytes`` looks up, a prompt's blocks rather than every transfer.
        self._carrying: dict[int, dict[int, Transfer]] = {}
        self._commits = 0
        self._committed_bytes = 0
        #: Decisions that found the oldest transfer still crossing overdue (``overdue``).
        self.overdue_samples = 0

    @property
    def backlog(self) -> Backlog:
        """This estimator's own commitments (one router replica's, or the simulator's)."""
        return self._own

    @property
    def goodput_gbps(self) -> float:
        return _BITS_PER_BYTE / self._spb / _GIGA

    def link(self, backlog: Backlog | None = None) -> LinkState:
        """The line as the next transfer finds it. ``backlog``: every replica's summed
        commitments, where a shared store has them; else this estimator's own."""
        b = self._own if backlog is None else backlog
        measured = None if self.frozen else self.goodput_gbps
        return replace(
            self.prior,
            measured_goodput_gbps=measured,
            backlog_bytes=max(0, b.bytes),
            backlog_transfers=max(0, b.transfers),
        )

    def prefill_tokens_per_s(self, instance_id: str) -> float:
        spt = self._prefill_spt.get(instance_id, self._prefill_prior_spt)
        return 1.0 / (self._prefill_prior_spt if self.frozen else spt)

    @property
    def relay_slot_s(self) -> float:
        """Seconds each request already on a relay adds to a new relayed request's first
        token (0 when frozen or not yet measured)."""
        return 0.0 if self.frozen else self._relay_slot_s

    def prefill_rates(self) -> Mapping[str, float]:
        """Measured prefill tokens/s per P instance (empty when frozen or none measured),
        read per P when asked (valid until the next sample): the policy asks about one P
        per request, and building the map would walk every measured P."""
        return {} if self.frozen else _Rates(self._prefill_spt)

    def commit(
        self, nbytes: int, prefill_id: str, prefill_tokens: int, now: float,
        backlog: Backlog | None = None, relayed: bool = False,
        main_id: str = "", carried: Iterable[int] = (),
    ) -> Transfer:  # fmt: skip
        """A route that ships ``nbytes`` of KV over the line was dispatched, to
        ``main_id`` with the prompt blocks ``carried`` (hashes)."""
        if nbytes < 0 or prefill_tokens < 0:
            raise ValueError("a transfer's bytes and prefill tokens must be >= 0")
        link = self.link(backlog)
        own = self._own
        others = Backlog(link.backlog_bytes - own.bytes, link.backlog_transfers - own.transfers)
        ahead = queued_ahead_bytes(self.link(others), nbytes)
        own_ahead = max(0, own.bytes)
        self._own = Backlog(self._own.bytes + nbytes, self._own.transfers + 1)
        self._commits += 1
        alone = link.backlog_transfers == 0
        transfer = Transfer(
            nbytes, prefill_id, prefill_tokens, now, ahead, relayed, main_id, frozenset(carried),
            alone, self._commits, own_ahead, self._committed_bytes,
        )  # fmt: skip
        self._committed_bytes += nbytes
        self._in_flight[id(transfer)] = transfer
        for h in transfer.carried:
            self._carrying.setdefault(h, {})[id(transfer)] = transfer
        return transfer

    def settle(self, transfer: Transfer) -> None:
        """The transfer is off the line, with no timing to learn from (it failed, or its
        request ended first)."""
        self._own = Backlog(self._own.bytes - transfer.nbytes, self._own.transfers - 1)
        if self._in_flight.pop(id(transfer), None) is None:
            return
        for h in transfer.carried:
            carriers = self._carrying[h]
            del carriers[id(transfer)]
            if not carriers:
                del self._carrying[h]

    def awaited_bytes(self, hashes: Iterable[int]) -> dict[str, int]:
        """Per MD, the bytes of the transfers still crossing to it that carry any of the
        prompt blocks ``hashes``: what a request counting on them waits for."""
        if not self._carrying:  # the common case on a quiet line: nothing to look up
            return {}
        awaited_by: dict[int, Transfer] = {}
        for h in hashes:
            awaited_by.update(self._carrying.get(h, {}))
        awaited: dict[str, int] = {}
        for t in awaited_by.values():
            awaited[t.main_id] = awaited.get(t.main_id, 0) + t.nbytes
        return awaited

    def overdue(self, now: float, backlog: Backlog | None = None) -> None:
        """Before a decision: learn from the oldest transfer still crossing, if it is
        late enough to show a slower line than believed (see the module docstring).
        ``backlog``: every replica's summed commitments, as for ``link``."""
        if self.frozen or not self._in_flight:
            return
        oldest = next(iter(self._in_flight.values()))
        b = self._own if backlog is None else backlog
        others_now = max(0, b.bytes - self._own.bytes)
        offered = (
            oldest.own_ahead_bytes + oldest.others_ahead_bytes + others_now
            + self._committed_bytes - oldest.committed_before
        )  # fmt: skip
        prefill_s = oldest.prefill_tokens / self.prefill_tokens_per_s(oldest.prefill_id)
        line_s = now - oldest.committed_at - prefill_s - self.prior.rtt_s - self.overhead_s
        allowed_s = offered * self._spb
        if offered <= 0 or line_s - allowed_s < MIN_OVERDUE_S:
            return
        self._spb += GAIN * (line_s / offered - self._spb)
        self.overdue_samples += 1

    def _arrived(self, at: float) -> Arrival:
        arrival = Arrival(at, self._last_arrival_at)
        self._last_arrival_at = max(self._last_arrival_at, at)
        return arrival

    def landed(
        self,
        transfer: Transfer,
        now: float,
        upper_bound: bool = False,
        shipped: Arrival | None = None,
    ) -> None:
        """MD has the transfer's KV: settle it and learn from its timing. ``upper_bound``:
        the time also holds a wait of unknown length (a relayed request's hand-off), so
        it can only show the line faster than the estimate. ``shipped``: what ``shipped``
        returned where P's report came first: it already settled the transfer, and the
        timing still counts here, since P's time alone only ever shows the line faster."""
        if shipped is None:
            self.settle(transfer)
        if self.frozen:
            return
        if shipped is not None:
            arrival = shipped
        elif upper_bound:  # MD's first token waited for the hand-off: not the line's clock
            arrival = Arrival(now, self._last_arrival_at)
        else:
            arrival = self._arrived(now)
        prefill_s = transfer.prefill_tokens / self.prefill_tokens_per_s(transfer.prefill_id)
        rtts = 2 if upper_bound else 1
        beyond = now - transfer.committed_at - prefill_s - rtts * self.prior.rtt_s
        # Landed behind another transfer (one landed since this one was committed): on
        # a line that sends one transfer after another, it crossed in the time since
        # that one landed; both landings lag the line alike, so the lag cancels.
        queued = arrival.previous > transfer.committed_at
        since_previous = arrival.at - arrival.previous
        serial_s = transfer.nbytes * self._spb
        line_s = beyond - self.overhead_s
        if serial_s < MIN_SAMPLE_S:
            if upper_bound or queued:
                return
            alone = transfer.alone and transfer.serial == self._commits
            if not (alone and self._small_shows_slow_line(serial_s, line_s)):
                fixed = beyond - serial_s  # the path's fixed cost: prefill, RTT aside
                self.overhead_s += GAIN * (max(0.0, fixed) - self.overhead_s)
                self.overhead_samples += 1
                return
            line_s = min(line_s, MAX_SLOWDOWN * serial_s)
        else:
            # P streamed the KV while it prefilled: the line's time overlapped the
            # prefill, so it is the whole time less the RTT and the fixed cost. Where that
            # is no longer than the prefill, the prefill may have paced the transfer: the
            # time bounds the line's from above only.
            line_s += prefill_s
            upper_bound = upper_bound or line_s <= prefill_s + MIN_SAMPLE_S
        if queued and not upper_bound:
            line_s = min(line_s, since_previous)
        # A time at or under zero is timing noise (P was faster than estimated), not an
        # infinitely fast line: no sample goes past MAX_OVER_DECLARED x the declared rate.
        floor = _seconds_per_byte(self.prior.declared_gbps * MAX_OVER_DECLARED)
        sample = max(floor, line_s / (transfer.nbytes + transfer.others_ahead_bytes))
        if upper_bound and sample >= self._spb:
            return  # the relay's wait, not the line, may be what made it this slow
        self._spb += GAIN * (sample - self._spb)
        self.goodput_samples += 1

    def _small_shows_slow_line(self, serial_s: float, line_s: float) -> bool:
        """A transfer too small to time the line at the estimate took ``MIN_SAMPLE_S``
        longer on it than that estimate allows, with bytes enough to be worth timing and
        the fixed cost known (see the module docstring)."""
        return (
            self.overhead_samples >= MIN_FIXED_SAMPLES
            and serial_s >= MIN_SAMPLE_S / 10
            and line_s - serial_s >= MIN_SAMPLE_S
        )

    def shipped(self, transfer: Transfer, kv_bytes: int, seconds: float, now: float) -> Arrival:
        """P timed the transfer: ``kv_bytes`` from its first chunk on the line to MD's
        "imported" in ``seconds``, an upper bound on the line's time (see the module
        docstring), reported to the router at ``now``. Settles it; the ``Arrival``
        returned goes to ``landed`` when MD's first token follows."""
        self.settle(transfer)
        arrival = self._arrived(now)
        if self.frozen or kv_bytes * self._spb < MIN_SAMPLE_S:
            return arrival  # too small to show the line beside the round trip's jitter
        # Only the transfer's own bytes: what it queued behind at dispatch may have
        # crossed before P's first chunk, and counting it would make the line look fast.
        # No faster than declared either: a bound cannot show more than the line has.
        floor = _seconds_per_byte(self.prior.declared_gbps)
        sample = max(floor, (seconds - self.prior.rtt_s) / kv_bytes)
        if sample < self._spb:  # slower may be P's and MD's engines, not the line
            self._spb += GAIN * (sample - self._spb)
            self.goodput_samples += 1
        return arrival

    def prefill_seen(
        self, instance_id: str, tokens: int, seconds: float, relay_active: int = 0
    ) -> None:
        """The relay streamed P's first token ``seconds`` after dispatch (P's queue and
        ``tokens`` of prefill included), with ``relay_active`` other requests on the relay
        at dispatch: an idle relay's time samples P, a busy one's the relay's queue."""
        if self.frozen or seconds <= 0:
            return
        fixed = self._prefill_fixed_s.get(instance_id, 0.0)
        if relay_active > 0:
            expected = fixed + tokens / self.prefill_tokens_per_s(instance_id)
            sample = max(0.0, seconds - expected) / relay_active
            self._relay_slot_s += GAIN * (sample - self._relay_slot_s)
            return
        if tokens < MIN_PREFILL_SAMPLE_TOKENS:
            self._prefill_fixed_s[instance_id] = fixed + GAIN * (seconds - fixed)
            return
        # Never faster than MAX_OVER_DECLARED x the prior: a time at or under the fixed
        # cost is noise, not an infinitely fast P.
        floor = self._prefill_prior_spt / MAX_OVER_DECLARED
        spt = self._prefill_spt.get(instance_id, self._prefill_prior_spt)
        sample = max(floor, (seconds - fixed) / tokens)
        self._prefill_spt[instance_id] = spt + GAIN * (sample - spt)


def _seconds_per_byte(gbps: float) -> float:
    return _BITS_PER_BYTE / (gbps * _GIGA)


class _Rates(Mapping[str, float]):
    """Tokens/s per P, read off the seconds per token learnt for it."""

    def __init__(self, seconds_per_token: Mapping[str, float]) -> None:
        self._spt = seconds_per_token

    def __getitem__(self, instance_id: str) -> float:
        return 1.0 / self._spt[instance_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._spt)

    def __len__(self) -> int:
        return len(self._spt)
