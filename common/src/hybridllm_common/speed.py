"""How fast each replica is, learned online from what the gateway measures of its answers.

One estimate for the whole platform: the gateway learns it from every answer and exports
it (`hybridllm_gateway_replica_*` metrics); the router predicts a request's time on each
candidate with it, and the autoscaler reads a pool's capacity from the same figures.

Two linear models per replica, each fitted by recursive least squares with exponential
forgetting (old answers fade, so a replica that slows down or speeds up is followed):

- time to first token: ``ttft = overhead + prompt_tokens / prefill_rate + wait * (load - 1)``,
  where ``load`` is the replica's outstanding requests when this one was sent (itself
  included): ``overhead`` is the network and the fixed cost of an answer (a site's gateway
  sees its WAN here), ``1 / prefill_rate`` the seconds per prompt token, ``wait`` the time
  each request ahead adds (its share of a busy batch);
- time per output token: ``tpot = decode + slowdown * (load - 1) + stall * stalled``:
  a continuous batch decodes every sequence each step, so a step grows with the batch;
  ``stalled`` is the prompt tokens of other answers the replica prefilled while this one
  was decoding (their first tokens came in its window), per output token: an engine that
  prefills a prompt whole holds every stream meanwhile (one that chunks its prefills, a
  little), so those prompts lengthen the answer's steps. Fitted apart, ``decode`` and ``slowdown`` are the decode step itself,
  which the autoscaler's capacity model needs (it counts the prefills' time in their own
  term); left in, an engine's stalls would count twice.

A replica's decode throughput at ``load`` concurrent requests is then ``load / tpot(load)``
tokens/s, and its prefill throughput ``prefill_rate``.

Answers are hostile input too (a replica can stall one answer, or a client can ask for a
prompt the gateway counts wrongly): each update is weighted down in proportion to how far
its error lies beyond a few times the model's typical error (a Huber weight), so an outlier
moves the fit by a bounded step. Until a replica has ``MIN_OBSERVATIONS`` answers, its
tier's pooled model (every replica of the tier) stands in for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MIN_OBSERVATIONS = 8
FORGETTING = 0.99  # the weight an answer keeps per later answer: ~100 answers of memory
HUBER_K = 3.0  # errors beyond this many typical errors get a smaller say
PROMPT_UNIT = 1000.0  # prompt tokens are fitted in thousands, to keep the problem well scaled
# The prefill rate is given only once its standard error is within this share of it: under
# load, the time to first token carries the queue's noise, and prompts of similar lengths
# (50-150 tokens, say) leave the slope to that noise (a "rate" of 3 or 3,000 tokens/s).
PREFILL_MAX_REL_ERROR = 0.25


class Rls:
    """Recursive least squares with exponential forgetting: ``y ~ theta . x``."""

    def __init__(self, dims: int, forgetting: float = FORGETTING, prior: float = 1e3) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError("forgetting must be in (0, 1]")
        self.dims, self.forgetting = dims, forgetting
        self.theta = [0.0] * dims
        self.p = [[prior if i == j else 0.0 for j in range(dims)] for i in range(dims)]
        self.count = 0
        self.scale = 0.0  # the typical absolute error (an exponential average)
        # the noise: an exponential average of the squared errors left after each update,
        # once the fit has more answers than unknowns (None before)
        self.noise_sq: float | None = None

    def predict(self, x: list[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def std_error(self, i: int) -> float:
        """The standard error of ``theta[i]``: the (forgetting-weighted) inverse
        information ``p[i][i]`` times the noise variance (infinite until it is known)."""
        if self.noise_sq is None:
            return math.inf
        return math.sqrt(max(self.p[i][i], 0.0) * self.noise_sq)

    def update(self, x: list[float], y: float) -> float:
        """Take one observation; the error of the prediction it had before."""
        if len(x) != self.dims or not all(math.isfinite(v) for v in (*x, y)):
            raise ValueError("an observation needs finite values, one per dimension")
        error = y - self.predict(x)
        weight = 1.0
        if self.count >= MIN_OBSERVATIONS and self.scale > 0:
            limit = HUBER_K * self.scale
            weight = min(1.0, limit / abs(error)) if error else 1.0
        px = [sum(self.p[i][j] * x[j] for j in range(self.dims)) for i in range(self.dims)]
        denominator = self.forgetting / weight + sum(x[i] * px[i] for i in range(self.dims))
        gain = [v / denominator for v in px]
        self.theta = [t + g * error for t, g in zip(self.theta, gain, strict=True)]
        self.p = [
            [(self.p[i][j] - gain[i] * px[j]) / self.forgetting for j in range(self.dims)]
            for i in range(self.dims)
        ]
        self.count += 1
        if self.count > self.dims:
            left = min((y - self.predict(x)) ** 2, (HUBER_K * self.scale) ** 2 or math.inf)
            self.noise_sq = left if self.noise_sq is None else 0.95 * self.noise_sq + 0.05 * left
        clipped = abs(error) if self.scale == 0 else min(abs(error), HUBER_K * self.scale)
        self.scale = clipped if self.count == 1 else 0.95 * self.scale + 0.05 * clipped
        return error


@dataclass(frozen=True)
class Answer:
    """What the gateway measured of one answer."""

    load: int  # the replica's outstanding requests when it was sent, itself included
    prompt_tokens: int  # the prompt's tokens not served from a prefix cache, as far as known
    ttft_s: float
    output_tokens: int
    decode_s: float  # from the first token to the last
    # prompt tokens of other answers whose first token came from the replica between this
    # one's first token and its last (their prefills; by this gateway: the ones it knows of)
    stalled_tokens: int = 0

    def valid(self) -> bool:
        return (
            self.load >= 1
            and self.prompt_tokens >= 0
            and math.isfinite(self.ttft_s)
            and self.ttft_s >= 0
            and math.isfinite(self.decode_s)
            and self.decode_s >= 0
            and self.stalled_tokens >= 0
        )


@dataclass
class ReplicaSpeed:
    """The two models of one replica (or of a tier, pooled)."""

    ttft: Rls = field(default_factory=lambda: Rls(3))
    tpot: Rls = field(default_factory=lambda: Rls(3))

    def observe(self, answer: Answer) -> None:
        """Learn from one answer; an answer whose numbers cannot be real is ignored."""
        if not answer.valid():
            return
        self.ttft.update(_ttft_x(answer.prompt_tokens, answer.load), answer.ttft_s)
        if answer.output_tokens >= 2:  # one token says nothing of the time between tokens
            steps = answer.output_tokens - 1
            self.tpot.update(
                _tpot_x(answer.load, answer.stalled_tokens / steps), answer.decode_s / steps
            )

    @property
    def observations(self) -> int:
        return self.ttft.count

    def ready(self) -> bool:
        return self.ttft.count >= MIN_OBSERVATIONS and self.tpot.count >= MIN_OBSERVATIONS

    def predict_ttft(self, prompt_tokens: int, load: int) -> float:
        return max(0.0, self.ttft.predict(_ttft_x(prompt_tokens, load)))

    def predict_tpot(self, load: int, stalled_per_token: float = 0.0) -> float:
        """Seconds per output token at ``load``: the decode step alone, or with
        ``stalled_per_token`` prompt tokens of others arriving per output token."""
        return max(0.0, self.tpot.predict(_tpot_x(load, stalled_per_token)))

    def predict_seconds(self, prompt_tokens: int, output_tokens: int, load: int) -> float:
        """The whole answer's time: first token, then the rest at the batch's pace."""
        rest = max(0, output_tokens - 1) * self.predict_tpot(load)
        return self.predict_ttft(prompt_tokens, load) + rest

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.ttft.theta[0])

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens per second (None: not measurably positive yet, or not known to
        within PREFILL_MAX_REL_ERROR: the answers' prompts vary too little for the noise)."""
        per_unit = self.ttft.theta[1]
        if per_unit <= 0 or self.ttft.std_error(1) > PREFILL_MAX_REL_ERROR * per_unit:
            return None
        return PROMPT_UNIT / per_unit

    @property
    def wait_s_per_request(self) -> float:
        return max(0.0, self.ttft.theta[2])

    def decode_tokens_per_s(self, load: int) -> float | None:
        """Output tokens per second of the whole replica with ``load`` answers at once."""
        tpot = self.predict_tpot(load)
        return load / tpot if tpot > 0 else None


def _ttft_x(prompt_tokens: int, load: int) -> list[float]:
    return [1.0, prompt_tokens / PROMPT_UNIT, float(load - 1)]


def _tpot_x(load: int, stalled_per_token: float = 0.0) -> list[float]:
    return [1.0, float(load - 1), stalled_per_token / PROMPT_UNIT]


class SpeedTable:
    """Every replica's speed by (tier, URL), with a pooled model per tier standing in for
    a replica until it has answered enough."""

    def __init__(self) -> None:
        self.replicas: dict[tuple[str, str], ReplicaSpeed] = {}
        self.tiers: dict[str, ReplicaSpeed] = {}

    def observe(self, tier: str, url: str, answer: Answer) -> ReplicaSpeed:
        speed = self.replicas.setdefault((tier, url), ReplicaSpeed())
        speed.observe(answer)
        self.tiers.setdefault(tier, ReplicaSpeed()).observe(answer)
        return speed

    def of(self, tier: str, url: str) -> ReplicaSpeed | None:
        """The replica's model once it is ready, else its tier's, else None."""
        own = self.replicas.get((tier, url))
        if own is not None and own.ready():
            return own
        pooled = self.tiers.get(tier)
        return pooled if pooled is not None and pooled.ready() else None

    def keep(self, live: set[tuple[str, str]]) -> list[tuple[str, str]]:
        """Forget the replicas not in ``live`` (gone from the routing table); those gone."""
        gone = [k for k in self.replicas if k not in live]
        for key in gone:
            del self.replicas[key]
        return gone


REFERENCE_LOAD = 8  # the busy batch at which the gateway also exports the time per token


@dataclass(frozen=True)
class TierSpeed:
    """A tier's speed as the gateways export it, over its replicas: what the autoscaler
    reads to learn a pool's capacity (``capacity: auto``). Each figure is the mean of the
    replicas' fitted values (None: no replica has one yet); ``answers`` counts the answers
    they were fitted from, summed."""

    prefill_tok_s: float | None
    tpot_1_s: float | None  # seconds per output token with one answer in flight
    tpot_ref_s: float | None  # ... with REFERENCE_LOAD answers in flight
    answers: float
    reference_load: int = REFERENCE_LOAD

    def step_s(self) -> tuple[float, float] | None:
        """The decode step as ``base + per_seq x batch`` seconds (the capacity model's
        form), from the two exported points of ``tpot = decode + slowdown x (load - 1)``;
        None while a figure is missing or not physical."""
        if self.tpot_1_s is None or self.tpot_ref_s is None or self.tpot_1_s <= 0:
            return None
        per_seq = max(0.0, (self.tpot_ref_s - self.tpot_1_s) / (self.reference_load - 1))
        # A replica that gains nothing from batching (a CPU busy on every core: each
        # sequence costs what one alone does) fits a base near zero, or below it by noise.
        base = max(self.tpot_1_s - per_seq, 0.01 * self.tpot_1_s)
        if not (math.isfinite(base) and math.isfinite(per_seq)):
            return None
        return base, per_seq


def mean_speed(rows: list[tuple[float | None, float | None, float | None, float]]) -> TierSpeed:
    """One tier's `TierSpeed` from its replicas' rows (prefill tokens/s, time per token
    at load 1 and at REFERENCE_LOAD, answers)."""

    def mean(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None and math.isfinite(v) and v > 0]
        return sum(known) / len(known) if known else None

    return TierSpeed(
        prefill_tok_s=mean([r[0] for r in rows]),
        tpot_1_s=mean([r[1] for r in rows]),
        tpot_ref_s=mean([r[2] for r in rows]),
        answers=sum(r[3] for r in rows if math.isfinite(r[3]) and r[3] > 0),
    )
