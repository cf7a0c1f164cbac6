"""Configuration: one pydantic-settings root model, loaded from YAML, overridden by
``FLOWSIEVE_…`` environment variables (nested with ``__``, e.g. ``FLOWSIEVE_SPARK__MASTER``).
Invalid values are refused at start; with no file the embedded defaults run a working daemon.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from importlib.resources import files
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

_YAML: ContextVar[str | None] = ContextVar("flowsieve_yaml", default=None)
SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def data_file(name: str) -> str:
    """A file shipped in collector/data (the sample capture, the example queries)."""
    return str(files("collector") / "data" / name)


def parse_size(v: int | str) -> int:
    """8589934592, '8GiB', '512M' → bytes."""
    if isinstance(v, int):
        return v
    m = SIZE_RE.match(str(v))
    if not m:
        raise ValueError(f"not a size: {v!r} (e.g. 512MiB, 8GiB)")
    unit = (m.group(2) or "").lower()[:1]
    return int(m.group(1)) * UNITS[unit]


DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(v: float | int | str) -> float:
    """3600, '90s', '30m', '12h', '30d', '2w' → seconds."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    m = DURATION_RE.match(str(v))
    if not m:
        raise ValueError(f"not a duration: {v!r} (e.g. 3600, 90s, 30m, 12h, 30d, 2w)")
    return float(m.group(1)) * SECONDS[m.group(2).lower()]


class ApiToken(BaseModel):
    """A bearer token and what it may do: ``read`` (GET routes) or ``admin`` (everything);
    the token itself, or a file holding it (a Docker or systemd secret: never in the
    environment or the configuration)."""

    token: SecretStr | None = Field(None, min_length=16)
    token_file: Path | None = Field(None, description="a file holding the token (its first "
                                    "line), read at start")
    scope: Literal["read", "admin"] = "read"

    @model_validator(mode="after")
    def _one_token(self) -> ApiToken:
        if (self.token is None) == (self.token_file is None):
            raise ValueError("a token needs exactly one of token and token_file")
        if self.token_file is not None:
            try:
                lines = self.token_file.read_text().splitlines()
            except OSError as e:
                raise ValueError(f"token_file {self.token_file}: {e.strerror}") from e
            text = lines[0].strip() if lines else ""
            if len(text) < 16:
                raise ValueError(f"token_file {self.token_file}: the token needs 16 or more "
                                 "characters")
            self.token = SecretStr(text)
        return self


class ApiConfig(BaseModel):
    host: str = Field("127.0.0.1", description="the address the API binds (a non-loopback "
                      "address needs a token)")
    port: int = Field(8080, ge=0, le=65535)
    token: SecretStr | None = Field(None, min_length=16, description="the admin bearer "
                                    "token (FLOWSIEVE_API__TOKEN); never logged")
    tokens: list[ApiToken] = Field(default_factory=list, description="more tokens, each with "
                                   "its scope")
    protect_reads: bool = Field(False, description="GET routes need a read or admin token "
                                "too (/healthz and /readyz stay open)")
    cors_origins: list[str] = Field(default_factory=list, description="origins allowed to "
                                    "call the API from a browser; none by default")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413")
    max_queries: int = Field(1000, ge=1, description="registrations past this get 429")

    @model_validator(mode="after")
    def _reads_need_a_token(self) -> ApiConfig:
        if self.protect_reads and not self.scopes():
            raise ValueError("api.protect_reads needs api.token or api.tokens")
        return self

    def scopes(self) -> list[tuple[bytes, str]]:
        """(token bytes, scope) of every configured token."""
        out = [(t.token.get_secret_value().encode(), t.scope) for t in self.tokens]
        if self.token is not None:
            out.append((self.token.get_secret_value().encode(), "admin"))
        return out


def cache_dir() -> Path:
    """flowsieve's per-user cache (``$XDG_CACHE_HOME/flowsieve``): the JVM's class-data
    archive that ``flowsieve prepare`` makes."""
    import os
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flowsieve"


class SparkConfig(BaseModel):
    master: str = "local[*]"
    driver_memory: str = "2g"
    shuffle_partitions: int = Field(4, ge=1, le=10000)
    state_store: Literal["rocksdb", "hdfs"] = "rocksdb"
    watermark_delay_s: int = Field(1, ge=1, description="a window closes once partials of a "
                                   "window that began this many seconds after its end arrive, "
                                   "or a heartbeat this long after its end")
    trigger_s: float = Field(2.0, gt=0)
    class_archive_dir: str | None = Field(None, description="the class-data archive's folder "
                                          "(default: the user's cache, ~/.cache/flowsieve, "
                                          "where flowsieve prepare makes it)")
    class_archive: bool = Field(True, description="start the JVM with the class-data archive "
                                "flowsieve prepare made (Spark starts sooner); no JVM of the "
                                "daemon or of replay writes one")
    restart_backoff_s: float = Field(30.0, gt=0, description="a failed streaming query "
                                     "restarts after this long, doubled while it keeps failing "
                                     "(at most 10 minutes)")
    answer_engine: Literal["python", "sql"] = Field(
        "python", description="who computes the answers on Spark's executors: python (Python "
        "tasks of flowsieve's); sql (Spark's own engine, from the queries compiled to Spark "
        "expressions, selections too: no Python on the executors)")
    answer_task_rows: int = Field(
        500_000, gt=0, description="a query without ORDER BY, LIMIT or a join whose node "
        "holds more merged rows than this in a batch is answered by several tasks (a part "
        "file each, by a hash of its keys), not one")
    extra: dict[str, str] = Field(default_factory=dict, description="any other spark.* setting")
    checkpoint_dir: Path | None = Field(None, description="the streaming queries' checkpoints "
                                        "(default var_dir/checkpoints); on a cluster, shared "
                                        "storage every worker writes (state stores)")

    @field_validator("driver_memory")
    @classmethod
    def _memory(cls, v: str) -> str:
        if not re.fullmatch(r"\d+[kmgt]?", v.lower()):
            raise ValueError(f"driver_memory {v!r} is not a JVM size such as 2g or 512m")
        return v


class SpoolConfig(BaseModel):
    max_bytes: int = Field(8 << 30, gt=0)
    policy: Literal["auto", "block", "drop"] = Field(
        "auto", description="when the spool is full: block (the source waits for Spark: "
        "nothing lost), drop (the rows are dropped and counted), or auto: capture files "
        "block, live interfaces and flow listeners drop (they cannot wait)")
    commit_s: float = Field(1.0, gt=0, description="a loop-free file source publishes its "
                            "spool files together with its read position this often (a "
                            "restart resumes there: nothing lost, nothing twice)")
    format: Literal["parquet", "arrow"] = Field("parquet", description="parquet: read by "
                                                "Spark's file source; arrow: Arrow IPC read by "
                                                "flowsieve's Python data source")
    path: Path | None = Field(None, description="the spool folder (default var_dir/spool); on "
                              "a cluster, shared storage that every probe writes and every "
                              "Spark worker reads")
    probe_timeout_s: float = Field(3600.0, gt=0, description="a probe whose status in the "
                                   "spool is older than this no longer holds back the release "
                                   "of deleted queries' slots")
    quarantine_max_age: float = Field(7 * 86400, gt=0, description="unreadable spool files "
                                      "set aside in <folder>/bad/ are removed after this long")

    @field_validator("quarantine_max_age", mode="before")
    @classmethod
    def _age(cls, v):
        return parse_duration(v)

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _size(cls, v):
        return parse_size(v)


class ResultsConfig(BaseModel):
    path: Path | None = Field(None, description="where Spark writes the queries' answers "
                              "(default var_dir/results); on a cluster, shared storage that "
                              "every Spark worker writes and the control plane reads")
    max_age: float | None = Field(30 * 86400, gt=0, description="each query keeps the answers "
                                  "written within this long (seconds, or 90s, 12h, 30d, 2w); "
                                  "null: no limit. A query may set its own (PATCH)")
    max_bytes: int | None = Field(None, gt=0, description="each query keeps at most this many "
                                  "bytes of answers, its oldest removed first (512MiB, 8GiB); "
                                  "null: no limit. A query may set its own (PATCH)")
    check_s: float = Field(60.0, gt=0, description="the daemon enforces retention this often")

    @field_validator("max_age", mode="before")
    @classmethod
    def _age(cls, v):
        return None if v is None else parse_duration(v)

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _bytes(cls, v):
        return None if v is None else parse_size(v)


class ReceiverConfig(BaseModel):
    """Where alerts go: Prometheus Alertmanager (its v2 API) or a webhook (JSON, signed)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["alertmanager", "webhook"]
    url: str = Field(..., pattern=r"^https?://", description="alertmanager: its base URL "
                     "(http://am:9093); webhook: the URL posted to")
    secret: SecretStr | None = Field(None, description="webhook: the HMAC-SHA256 key of the "
                                     "X-Flowsieve-Signature header")
    secret_file: Path | None = Field(None, description="webhook: a file holding the secret")
    timeout_s: float = Field(5.0, gt=0, le=300)
    resend_s: float = Field(60.0, gt=0, description="alertmanager: firing alerts are sent "
                            "again this often (before its resolve_timeout ends them)")
    max_pending: int = Field(10000, ge=1, description="notifications held for a receiver "
                             "that is down; beyond, the oldest are dropped and counted")
    max_backoff_s: float = Field(300.0, gt=0, description="retries back off exponentially "
                                 "(with jitter) up to this")

    @model_validator(mode="after")
    def _secret(self) -> ReceiverConfig:
        if self.secret_file is not None:
            if self.secret is not None:
                raise ValueError("a receiver takes secret or secret_file, not both")
            try:
                self.secret = SecretStr(self.secret_file.read_text().splitlines()[0].strip())
            except (OSError, IndexError) as e:
                raise ValueError(f"secret_file {self.secret_file}: cannot read it") from e
        return self


class AlertsConfig(BaseModel):
    """Alert rules on queries (collector/daemon/alerts/): their receivers and pace."""

    receivers: dict[str, ReceiverConfig] = Field(default_factory=dict, description="name -> "
                                                 "receiver, named by the rules")
    check_s: float = Field(2.0, gt=0, description="closed windows are read for alerts this "
                           "often")
    keep_resolved_s: float = Field(86400.0, gt=0, description="GET /alerts lists resolved "
                                   "alerts this long")
    public_url: str | None = Field(None, description="the API's address as receivers' users "
                                   "reach it (an alert's generatorURL); default api.host:port")


class PlannerConfig(BaseModel):
    cheap_cost: float = Field(10.0, gt=0, description="base predicates up to this cost are "
                              "prefilter candidates")
    bit_budget: int | None = Field(64, ge=0, description="prefilter bits (several 64-bit words "
                                   "beyond 64); null = one per rectangle of the cover")
    max_j: int = Field(4, ge=1, le=16, description="most predicates in a rectangle grown by "
                       "Figure 4 (columns may hold more)")
    hfta_row_cost: float = Field(200.0, ge=0, description="aggregate trees: the cost of one "
                                 "partial row through Spark, in tuple hashes of the LFTA")
    measure_tuples: int = Field(262_144, ge=0, description="replay measures selectivities and "
                                "node sizes on this many first packets or flows before it plans "
                                "(0: plan on defaults)")


class AscConfig(BaseModel):
    min_constants: int = Field(16, ge=1, description="an attribute whose predicates use this "
                               "many distinct constants (range bounds included) is served by "
                               "an ASC; fewer are cheaper as prefilter bits")
    strategy: Literal["hybrid", "macro", "fixed"] = "hybrid"
    period_tuples: int = Field(100_000, ge=1, description="λ: tuples per monitoring period")
    mu: float = Field(0.1, ge=0, description="μ: re-choose the ASC sequence when the dropping "
                      "ratio moved by this fraction (eq. 5)")
    sample: int = Field(2048, ge=16, le=1 << 20, description="tuples sampled per period")


class ResidualConfig(BaseModel):
    """The residual stage (collector/pipeline/residual.py): the predicates the prefilter left."""

    ordering: Literal["a-greedy", "sweep", "independent", "localswaps", "cost"] = Field(
        "a-greedy", description="how residual predicates are ordered: adaptively (seed 001: "
        "A-Greedy or its variants) or by catalogue cost alone")
    profile_probability: float = Field(0.01, gt=0, le=1, description="a dropped tuple is "
                                       "profiled (every later predicate run on it) with this "
                                       "probability")
    profile_window: int = Field(1000, ge=10, description="profile tuples the ordering is "
                                "chosen on (a sliding window)")
    alpha: float = Field(0.9, gt=0, le=1, description="thrashing avoidance: reorder only when "
                         "a later predicate drops more per unit of time by 1/alpha")
    sweep_stage: int = Field(500, ge=10, description="Sweep: profile tuples per stage")
    profile_budget: float = Field(0.1, gt=0, le=1, description="profiling's share of the "
                                  "residual stage's time at most (it pauses beyond)")
    adapt: bool = Field(True, description="profiling and the value cache measure what they "
                        "save and turn themselves down where it is less than they cost "
                        "(false: always at profile_probability, the cache always used)")
    value_cache: int = Field(65536, ge=0, description="outcomes of regular expressions kept "
                             "by value (LRU; DNS names repeat); 0: none")


class OmConfig(BaseModel):
    """OM plan charts (planner/charts.py): each maintained LFTA node runs the physical plan
    (pass-through, or a hash table of a capacity and flush policy) its sel-λ chart indexes at
    the estimated selectivity and arrival rate, switched at window boundaries."""

    enabled: bool = Field(True, description="false: every node keeps lfta.capacity")
    k: int = Field(10, ge=1, le=100, description="partitions of each chart dimension")
    w_r: float = Field(1e9, ge=0, description="weight of 1 / output rate (tuples/s)")
    w_m: float = Field(0.05, ge=0, description="weight of memory (rows held)")
    lambda_max: float = Field(2e7, gt=0, description="tuples/s at the chart's top")
    lambda_min: float = Field(100, gt=0, description="tuples/s at its bottom (log scale)")
    lambda_scale: Literal["log", "linear"] = Field("log", description="how arrival rates are "
                                                   "partitioned (linear: the paper's)")
    capacities: list[int] = Field([4096, 65536, 1 << 20], min_length=1, description="table "
                                  "capacities the charts choose between")
    age_fraction: float = Field(0.25, gt=0, le=1, description="an age-flushed table empties "
                                "every this fraction of its window (1: no such plans)")
    passthrough: bool = Field(True, description="tuples may bypass a table (low rates; only "
                              "where spark.watermark_delay_s covers the period, as age flushes)")
    spark_rows_per_s: float = Field(250_000, gt=0, description="Spark's merge rate, shared "
                                    "by the nodes (FACTS: stateful merge in local[2])")
    lfta_tuples_per_s: float = Field(20e6, gt=0, description="a table's merge rate")
    history: int = Field(5, ge=1, description="d: rounds the estimates weigh")
    decay: float = Field(0.5, ge=0, description="a in G(r) = exp(-a r) (the estimates also "
                         "try 0, 2a, 4a and 16a and use the one that predicted best lately)")
    refine: int = Field(8, ge=1, le=64, description="a region whose plan changes inside it is "
                        "split into refine x refine cells (1: the paper's k x k chart)")
    spread: bool = Field(True, description="run the plan the chart indexes most often over "
                         "the estimates spread by their own error (false: at the point)")

    def chart_options(self, max_load: float, watermark_delay_s: float):
        from planner.charts import ChartOptions
        return ChartOptions(k=self.k, w_r=self.w_r, w_m=self.w_m, lambda_max=self.lambda_max,
                            lambda_min=self.lambda_min, lambda_scale=self.lambda_scale,
                            capacities=tuple(self.capacities), max_load=max_load,
                            age_fraction=self.age_fraction, passthrough=self.passthrough,
                            spark_rows_per_s=self.spark_rows_per_s,
                            watermark_delay_s=watermark_delay_s,
                            lfta_tuples_per_s=self.lfta_tuples_per_s, refine=self.refine,
                            spread=self.spread)


class LftaConfig(BaseModel):
    """Partial aggregation before the spool (collector/pipeline/lfta.py): a table per node."""

    enabled: bool = Field(True, description="merge tuples into partial aggregates before the "
                          "spool (false: one spool row per tuple and node)")
    capacity: int = Field(1 << 16, ge=16, le=1 << 26, description="slots per node table "
                          "(a power of two; about capacity × 8 × key words bytes); with om "
                          "enabled, a node's chart chooses among om.capacities instead")
    max_load: float = Field(0.5, gt=0, le=0.9, description="a table is flushed when this "
                            "fraction of its slots is used")
    max_age_s: float = Field(60.0, gt=0, description="rows never wait longer than this in a "
                             "table (flushed whole)")
    hll_lg_k: int = Field(12, ge=4, le=21, description="log2 of the registers of the "
                          "HyperLogLog sketches of approx_count_distinct (DataSketches HLL_8: "
                          "relative standard error about 1.04 / 2^(lg_k/2), 1.6 % at 12)")


class EnrichDatabase(BaseModel):
    """One MMDB file; ``paths``: where its records keep an attribute, when not where MaxMind's
    do (e.g. IPinfo's ASN database: ``{asn: asn}``)."""

    model_config = ConfigDict(extra="forbid")
    path: Path
    paths: dict[str, str] = Field(default_factory=dict)


class SnmpCredentials(BaseModel):
    """How to poll one device: SNMP v2c with ``community``, or v3 with ``user`` (authPriv with
    both keys, authNoPriv with ``auth_key`` only)."""

    model_config = ConfigDict(extra="forbid")
    community: SecretStr | None = None
    user: str | None = None
    auth_protocol: Literal["md5", "sha", "sha224", "sha256", "sha384", "sha512"] = "sha"
    auth_key: SecretStr | None = None
    priv_protocol: Literal["des", "aes", "aes192", "aes256"] = "aes"
    priv_key: SecretStr | None = None
    host: str | None = Field(None, description="where to send the requests (default: the "
                             "device's address as its flows or samples name it)")
    port: int = Field(161, ge=1, le=65535)

    @model_validator(mode="after")
    def _one(self) -> SnmpCredentials:
        if (self.community is None) == (self.user is None):
            raise ValueError("give a community (SNMP v2c) or a user (SNMP v3)")
        if self.user is not None and self.auth_key is None and self.priv_key is not None:
            raise ValueError("a priv_key needs an auth_key")
        return self


class SnmpConfig(BaseModel):
    """Interface names, descriptions and speeds polled from exporters and agents."""

    model_config = ConfigDict(extra="forbid")
    refresh_s: float = Field(300.0, gt=0, description="how often each device is polled")
    timeout_s: float = Field(2.0, gt=0, le=60)
    retries: int = Field(1, ge=0, le=10)
    default: SnmpCredentials | None = Field(None, description="credentials for every exporter "
                                            "and sFlow agent seen that devices does not name")
    devices: dict[str, SnmpCredentials] = Field(default_factory=dict, description="device "
                                                "address -> its credentials")

    @field_validator("devices")
    @classmethod
    def _addresses(cls, v: dict) -> dict:
        import ipaddress
        for device in v:
            ipaddress.ip_address(device)
        return v


class EnrichConfig(BaseModel):
    """Enrichment databases (capture/enrich/): each is optional; a query that reads a field of
    one that is not configured is refused at registration."""

    model_config = ConfigDict(extra="forbid")
    asn: EnrichDatabase | None = Field(None, description="MMDB of AS numbers (GeoLite2-ASN, "
                                       "IPinfo ASN, DB-IP ASN): src_asn, dst_asn, "
                                       "src_as_name, dst_as_name")
    country: EnrichDatabase | None = Field(None, description="MMDB of countries (GeoLite2-"
                                           "Country or -City, IPinfo, DB-IP): src_country, "
                                           "dst_country, src_continent, dst_continent")
    city: EnrichDatabase | None = Field(None, description="MMDB of cities (GeoLite2-City, "
                                        "DB-IP City): src_city, dst_city, src_region, "
                                        "dst_region")
    networks: Path | None = Field(None, description="the operator's prefixes: a YAML map of "
                                  "prefix to a name or {name, role, site}: src_net_name, "
                                  "src_net_role, src_net_site and dst_ …")
    interfaces: Path | None = Field(None, description="interfaces of exporters and agents: a "
                                    "YAML map of device address to ifIndex to a name or "
                                    "{name, description, speed}; over what SNMP finds")
    snmp: SnmpConfig | None = None
    asn_precedence: Literal["exporter", "exporter-public", "database"] = Field(
        "exporter", description="src_asn/dst_asn of flows and sFlow samples: exporter: the AS "
        "the exporter sent where it sent one (not 0), else the database's; exporter-public: "
        "the same, an exporter's private AS (64512-65534, 4200000000-4294967294) or AS_TRANS "
        "counting as none; database: the database's where it has the address")
    reload_s: float = Field(60.0, gt=0, description="how often the daemon checks the files; "
                            "one that changed is compiled in the background and taken between "
                            "batches")

    @field_validator("asn", "country", "city", mode="before")
    @classmethod
    def _path(cls, v):
        return {"path": v} if isinstance(v, str | Path) else v

    def databases(self) -> dict[str, tuple[str, dict[str, str]]]:
        """``capture.enrich.configure``'s argument."""
        out = {name: (str(db.path), dict(db.paths))
               for name, db in (("asn", self.asn), ("country", self.country),
                                ("city", self.city)) if db}
        if self.networks is not None:
            out["networks"] = (str(self.networks), {})
        if self.interfaces is not None or self.snmp is not None:
            out["interfaces"] = (str(self.interfaces or ""), {})
        return out


class SourceConfig(BaseModel):
    """A source: a capture file (``pcap``, also pcapng), a Linux interface, a UDP listener
    of NetFlow v5/v9/IPFIX exports (``netflow``: the flows stream) or of sFlow v5 datagrams
    (``sflow``: the samples and counters streams)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["pcap", "interface", "netflow", "sflow"] = "pcap"
    name: str = "sample"
    spool_full: Literal["block", "drop"] | None = Field(
        None, description="this source's policy when the spool is full (default: "
        "spool.policy)")
    # type pcap
    path: str = Field(default_factory=lambda: data_file("sample.pcap"))
    loop: bool = True
    restamp: bool = Field(True, description="shift times so each loop replays at the current "
                          "time, at the capture's own pace (a followed file keeps its own, "
                          "live times, and its quiet times close windows either way)")
    follow: bool = Field(False, description="keep reading the file as it grows (tcpdump -w)")
    # type interface
    interface: str | None = Field(None, description="Linux interface (AF_PACKET, TPACKET_V3)")
    bpf: bool = Field(True, description="attach the plan's kernel filter (needs libpcap)")
    ring_block_size: int = Field(1 << 22, ge=1 << 16, le=1 << 30)
    ring_blocks: int = Field(64, ge=2, le=1 << 16)
    skip_outgoing: bool = Field(False, description="leave out packets this host sends")
    promisc: bool = True
    # type netflow (and sflow)
    listen: list[str] = Field(default_factory=lambda: ["0.0.0.0:2055", "0.0.0.0:4739"],
                              description="HOST:PORT to receive exports on; [::]:PORT for IPv6 "
                              "(type sflow: default 0.0.0.0:6343)")
    rcvbuf: int = Field(32 << 20, ge=1 << 16, description="socket receive buffer (bytes)")
    sampling: dict[str, int] = Field(default_factory=dict, description="exporter address -> "
                                     "sampling interval, overriding what the exporter says")
    default_sampling_interval: int = Field(1, ge=1, description="interval of records whose "
                                           "sampling is unknown (counted)")
    enterprise_fields: dict[str, str] = Field(
        default_factory=dict, description="'PEN/ELEMENT' -> flows field, e.g. "
        "'2636/137': input_if; other enterprise-specific fields are skipped")
    pending_max_bytes: int = Field(4 << 20, ge=0, description="data held until its template "
                                   "arrives (oldest evicted first, counted)")
    pending_ttl_s: float = Field(300.0, gt=0, description="held data older than this is "
                                 "counted as template_missing")

    @field_validator("rcvbuf", "pending_max_bytes", mode="before")
    @classmethod
    def _bytes(cls, v):
        return parse_size(v)

    @property
    def stream(self) -> str:
        """The stream of its engine (an sflow source also feeds ``counters``)."""
        return {"netflow": "flows", "sflow": "samples"}.get(self.type, "packets")

    @property
    def listens(self) -> bool:
        return self.type in ("netflow", "sflow")

    def spool_policy(self, default: str) -> str:
        """What this source does when the spool is full: its own ``spool_full``, else
        ``spool.policy``; ``auto`` blocks a capture file (it can wait, and loses nothing) and
        drops for a live source (an interface or a flow listener cannot wait)."""
        if self.spool_full is not None:
            return self.spool_full
        if default != "auto":
            return default
        return "block" if self.type == "pcap" else "drop"

    def enterprise_map(self) -> dict[tuple[int, int], str]:
        return {(int(k.split("/")[0]), int(k.split("/")[1])): v
                for k, v in self.enterprise_fields.items()}

    @model_validator(mode="after")
    def _check(self) -> SourceConfig:
        if self.type == "sflow" and "listen" not in self.model_fields_set:
            self.listen = ["0.0.0.0:6343"]
        if self.listens:
            from capture.fields import fields
            from capture.listen import parse_address
            for a in self.listen:
                parse_address(a)
            for k, v in self.enterprise_fields.items():
                if not re.fullmatch(r"\d+/\d+", k):
                    raise ValueError(f"enterprise_fields key {k!r} is not PEN/ELEMENT")
                if v not in fields("flows"):
                    raise ValueError(f"enterprise_fields {k}: {v!r} is not a flows field")
            return self
        if self.type == "interface" and not self.interface:
            raise ValueError(f"source {self.name!r}: type interface needs `interface`")
        if self.type == "pcap" and not self.follow and not Path(self.path).is_file():
            raise ValueError(f"source {self.name!r}: capture {self.path} does not exist")
        return self


class Settings(BaseSettings):
    """The root configuration."""

    model_config = SettingsConfigDict(env_prefix="FLOWSIEVE_", env_nested_delimiter="__",
                                      extra="forbid")

    var_dir: Path = Field(Path("var"), description="spool/, results/, checkpoints/, registry")
    probe: str = Field("flowsieve", pattern=r"^[A-Za-z0-9_-]{1,64}$",
                       description="this capture daemon's name: its spool files and rows carry "
                                   "it (several probes may write one spool)")
    role: Literal["all", "capture"] = Field(
        "all", description="all: the control plane (registry, API, Spark job) and any sources; "
        "capture: sources only, running the queries the control plane publishes in the shared "
        "spool (several capture daemons, one Spark job)")
    api: ApiConfig = Field(default_factory=ApiConfig)
    spark: SparkConfig = Field(default_factory=SparkConfig)
    spool: SpoolConfig = Field(default_factory=SpoolConfig)
    planner: PlannerConfig = Field(default_factory=PlannerConfig)
    asc: AscConfig = Field(default_factory=AscConfig)
    lfta: LftaConfig = Field(default_factory=LftaConfig)
    residual: ResidualConfig = Field(default_factory=ResidualConfig)
    om: OmConfig = Field(default_factory=OmConfig)
    results: ResultsConfig = Field(default_factory=ResultsConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    batch_size: int = Field(65536, ge=1, le=1 << 22)
    shutdown_timeout_s: float = Field(
        20.0, gt=0, le=600, description="a stop (SIGTERM) ends within this: sources stop and "
        "flush, Spark merges what the spool holds and stops between batches, its JVM exits "
        "(killed at the end of this time); give a container's stop grace period more")
    replay_workers: int = Field(
        0, ge=0, le=64, description="processes that read a classic pcap file in flowsieve "
        "replay, each a byte range with its own engine writing the one spool (0: one per CPU "
        "core but one (Spark's JVM runs its first job meanwhile), at most 4, each range "
        "at least 64 MiB)")
    sources: list[SourceConfig] = Field(default_factory=lambda: [SourceConfig()])
    initial_queries: str | None = Field(
        default_factory=lambda: data_file("example.sql"),
        description="a .sql file registered when the registry is empty")
    registry: str = Field("sqlite", pattern="^sqlite$")
    tables: dict[str, Path] = Field(default_factory=dict, description="prefix tables for "
                                    "in_table(field, 'name'): name -> file of CIDR prefixes, "
                                    "one per line (# comments); read again when it changes")
    enrich: EnrichConfig = Field(default_factory=EnrichConfig)
    predicates: dict[str, str] = Field(
        default_factory=dict, description="user predicates for WHERE: name -> "
        "'package.module:function' (collector/pipeline/user_predicates.py); installed "
        "packages may also offer them in the flowsieve.predicates entry-point group")

    @model_validator(mode="after")
    def _check(self) -> Settings:
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique: {names}")
        if self.initial_queries and not Path(self.initial_queries).is_file():
            raise ValueError(f"initial_queries {self.initial_queries} does not exist")
        return self

    def plan_options(self) -> dict:
        """build_plan's options: the one planner configuration the daemon, ``flowsieve plan``
        and ``flowsieve replay`` all compile with."""
        return {"cheap_cost": self.planner.cheap_cost, "bit_budget": self.planner.bit_budget,
                "max_j": self.planner.max_j, "asc_min_constants": self.asc.min_constants,
                "hfta_row_cost": self.planner.hfta_row_cost,
                "charts": self.om.chart_options(self.lfta.max_load,
                                                self.spark.watermark_delay_s)
                if self.om.enabled and self.lfta.enabled else None}

    @property
    def spool_dir(self) -> Path:
        return self.spool.path or self.var_dir / "spool"

    @property
    def results_dir(self) -> Path:
        return self.results.path or self.var_dir / "results"

    @property
    def checkpoint_dir(self) -> Path:
        return self.spark.checkpoint_dir or self.var_dir / "checkpoints"

    @property
    def registry_path(self) -> Path:
        return self.var_dir / "flowsieve.db"

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _YAML.get()
        if path:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


def load_settings(path: str | Path | None = None, **overrides) -> Settings:
    """Settings from a YAML file (or the embedded defaults), env overrides applied."""
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    token = _YAML.set(str(path) if path else None)
    try:
        settings = Settings(**overrides)
    finally:
        _YAML.reset(token)
    return settings
