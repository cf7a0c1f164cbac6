-- The telemetry applications of the literature (Sonata, SIGCOMM 2018; Marple; Gigascope) in
-- flowsieve SQL, each with a threshold, per one-minute window. bench/telemetry/attacks.py
-- injects the attacks into a backbone-shaped background; the thresholds sit above the largest
-- value the background reaches (tests/test_telemetry.py: only the attacks cross them).

-- new TCP connections per host: SYNs without ACK
-- name: new_tcp
SELECT time/60 AS t, dst_ip, count(*) AS syns FROM packets
WHERE protocol = 6 AND (tcp_flags & 18) = 2
GROUP BY time/60, dst_ip HAVING count(*) > 1000;

-- bytes of IP sent per host
-- name: heavy_hitters
SELECT time/60 AS t, src_ip, sum(ip_len) AS bytes FROM packets
WHERE ip_version IN (4, 6)
GROUP BY time/60, src_ip HAVING sum(ip_len) > 10000000;

-- distinct destinations per source
-- name: superspreader
SELECT time/60 AS t, src_ip, count(DISTINCT dst_ip) AS dsts FROM packets
WHERE ip_version IN (4, 6)
GROUP BY time/60, src_ip HAVING count(DISTINCT dst_ip) > 2500;

-- distinct destination ports per TCP source
-- name: port_scan
SELECT time/60 AS t, src_ip, count(DISTINCT dst_port) AS ports FROM packets
WHERE protocol = 6
GROUP BY time/60, src_ip HAVING count(DISTINCT dst_port) > 2000;

-- SYNs a host receives minus the SYN-ACKs it sends
-- name: syn_flood
WITH syn AS (SELECT time/60 AS t, dst_ip, count(*) AS n FROM packets
             WHERE protocol = 6 AND (tcp_flags & 18) = 2 GROUP BY time/60, dst_ip),
     ack AS (SELECT time/60 AS t, src_ip, count(*) AS n FROM packets
             WHERE protocol = 6 AND (tcp_flags & 18) = 18 GROUP BY time/60, src_ip)
SELECT syn.t AS t, syn.dst_ip AS host, syn.n - coalesce(ack.n, 0) AS half_open
FROM syn LEFT JOIN ack ON syn.t = ack.t AND syn.dst_ip = ack.src_ip
WHERE syn.n - coalesce(ack.n, 0) > 1000;

-- connections a host is asked to open minus those closed (FIN)
-- name: completed_flows
WITH syn AS (SELECT time/60 AS t, dst_ip, count(*) AS n FROM packets
             WHERE protocol = 6 AND (tcp_flags & 18) = 2 GROUP BY time/60, dst_ip),
     fin AS (SELECT time/60 AS t, dst_ip, count(*) AS n FROM packets
             WHERE protocol = 6 AND tcp_flags & 1 != 0 GROUP BY time/60, dst_ip)
SELECT syn.t AS t, syn.dst_ip AS host, syn.n - coalesce(fin.n, 0) AS open
FROM syn LEFT JOIN fin ON syn.t = fin.t AND syn.dst_ip = fin.dst_ip
WHERE syn.n - coalesce(fin.n, 0) > 1000;

-- many connections to a host carrying few bytes each
-- name: slowloris
WITH c AS (SELECT time/60 AS t, dst_ip, count(DISTINCT src_port) AS conns FROM packets
           WHERE protocol = 6 GROUP BY time/60, dst_ip),
     b AS (SELECT time/60 AS t, dst_ip, sum(ip_len) AS bytes FROM packets
           WHERE protocol = 6 GROUP BY time/60, dst_ip)
SELECT c.t AS t, c.dst_ip AS host, c.conns AS conns, b.bytes / c.conns AS per_conn
FROM c JOIN b ON c.t = b.t AND c.dst_ip = b.dst_ip
WHERE c.conns > 1000 AND b.bytes / c.conns < 500;

-- UDP packets a host receives minus those it sends
-- name: udp_asym
WITH i AS (SELECT time/60 AS t, dst_ip, count(*) AS n FROM packets WHERE protocol = 17
           GROUP BY time/60, dst_ip),
     o AS (SELECT time/60 AS t, src_ip, count(*) AS n FROM packets WHERE protocol = 17
           GROUP BY time/60, src_ip)
SELECT i.t AS t, i.dst_ip AS host, i.n - coalesce(o.n, 0) AS excess
FROM i LEFT JOIN o ON i.t = o.t AND i.dst_ip = o.src_ip
WHERE i.n - coalesce(o.n, 0) > 5000;

-- TXT responses a host receives from distinct resolvers
-- name: dns_reflection
SELECT time/60 AS t, dst_ip, count(DISTINCT src_ip) AS resolvers FROM packets
WHERE protocol = 17 AND src_port = 53 AND dns_qr = 1 AND dns_an_type = 16
GROUP BY time/60, dst_ip HAVING count(DISTINCT src_ip) > 100;

-- distinct TTLs answered for one name (fast flux)
-- name: dns_ttl
SELECT time/60 AS t, dns_an_name, count(DISTINCT dns_an_ttl) AS ttls FROM packets
WHERE dns_qr = 1 AND dns_ancount > 0
GROUP BY time/60, dns_an_name HAVING count(DISTINCT dns_an_ttl) > 4;

-- distinct sources per SSH server and packet length
-- name: ssh_brute
SELECT time/60 AS t, dst_ip, ip_len, count(DISTINCT src_ip) AS srcs FROM packets
WHERE protocol = 6 AND dst_port = 22
GROUP BY time/60, dst_ip, ip_len HAVING count(DISTINCT src_ip) > 100
