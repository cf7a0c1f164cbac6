-- flowsieve prepare's warm-up queries (api/prepare.py): a query of each class over each stream,
-- so that every kernel they reach is compiled into numba's cache at install. Their tables' key
-- layouts (fields, address fields) are the common ones; one-second windows close while the
-- shipped captures are read.
-- name: w_udp_pairs
SELECT time/60 AS t, src_ip, dst_ip, sum(wirelen) AS bytes, count(*) AS pkts
FROM packets WHERE protocol = 17 GROUP BY time/60, src_ip, dst_ip;
-- name: w_tcp_top
SELECT time/1 AS t, dst_port, count(*) AS n, sum(wirelen) AS b, min(wirelen) AS lo,
       max(wirelen) AS hi, avg(ip_len) AS mean
FROM packets WHERE protocol = 6 GROUP BY time/1, dst_port
HAVING count(*) >= 2 ORDER BY n DESC LIMIT 3;
-- name: w_protocols
SELECT time/1 AS t, protocol, ip_version, count(*) AS n, sum(ip_len) AS b FROM packets
GROUP BY time/1, protocol, ip_version;
-- name: w_five_tuple
SELECT time/2 AS t, src_ip, dst_ip, src_port, dst_port, protocol, count(*) AS n,
       sum(wirelen) AS b
FROM packets WHERE ttl >= 1 GROUP BY time/2, src_ip, dst_ip, src_port, dst_port, protocol;
-- name: w_talkers
SELECT time/1 AS t, src_ip, count(*) AS n, sum(wirelen) AS b FROM packets
WHERE NOT in_prefix(src_ip, 'fe80::/10') GROUP BY time/1, src_ip ORDER BY b DESC LIMIT 5;
-- name: w_local
SELECT time/2 AS t, dst_ip, dst_port, count(*) AS n FROM packets
WHERE in_prefix(src_ip, '10.0.0.0/8') AND dst_port < 1024 GROUP BY time/2, dst_ip, dst_port;
-- name: w_fanout
SELECT time/2 AS t, src_ip, count(DISTINCT dst_ip) AS dsts, count(DISTINCT dst_port) AS ports,
       count(*) AS n
FROM packets WHERE protocol = 17 OR protocol = 6 GROUP BY time/2, src_ip
HAVING count(DISTINCT dst_ip) >= 1;
-- name: w_approx
SELECT time/2 AS t, src_ip, approx_count_distinct(dst_ip) AS dsts, count(*) AS n FROM packets
WHERE protocol = 17 OR protocol = 6 GROUP BY time/2, src_ip;
-- name: w_nets
SELECT time/2 AS t, prefix(dst_ip, 24) AS net, count(DISTINCT src_ip) AS srcs, count(*) AS n
FROM packets WHERE protocol = 17 GROUP BY time/2, prefix(dst_ip, 24);
-- name: w_syn
SELECT time/1 AS t, dst_ip, count(*) AS n FROM packets WHERE (tcp_flags & 18) = 2
GROUP BY time/1, dst_ip;
-- name: w_services
SELECT time/1 AS t, dst_port, protocol, count(*) AS n FROM packets
WHERE dst_port IN (20, 21, 22, 23, 25, 53, 80, 110, 123, 143, 161, 443, 465, 587, 993, 995,
                   1900, 3306, 5353, 8080)
GROUP BY time/1, dst_port, protocol;
-- name: w_dns_names
SELECT time/1 AS t, dns_qname, count(*) AS n FROM packets
WHERE dst_port = 53 AND regexp(dns_qname, '[a-z]') GROUP BY time/1, dns_qname;
-- name: w_dns_answers
SELECT time/2 AS t, dns_an_name, dns_an_addr, count(DISTINCT dns_an_ttl) AS ttls, count(*) AS n
FROM packets WHERE dns_qr = 1 AND dns_an_type IN (1, 28) GROUP BY time/2, dns_an_name, dns_an_addr;
-- name: w_http
SELECT ts, src_ip, dst_ip, src_port, dst_port, payload FROM packets
WHERE protocol = 6 AND contains(payload, 'HTTP/1.1');
-- name: w_dns_sel
SELECT ts, src_ip, dst_port, dns_qname FROM packets WHERE protocol = 17 AND dst_port = 53;
-- name: w_half_open
WITH syn AS (SELECT time/1 AS t, dst_ip, count(*) AS n FROM packets
             WHERE (tcp_flags & 18) = 2 GROUP BY time/1, dst_ip),
     synack AS (SELECT time/1 AS t, src_ip, count(*) AS n FROM packets
                WHERE (tcp_flags & 18) = 18 GROUP BY time/1, src_ip)
SELECT syn.t AS t, syn.dst_ip AS host, syn.n AS syns, synack.n AS acks,
       syn.n - coalesce(synack.n, 0) AS open
FROM syn LEFT JOIN synack ON syn.t = synack.t AND syn.dst_ip = synack.src_ip;
-- name: w_as_pairs
SELECT time/2 AS t, src_asn, dst_asn, count(*) AS n, sum(wirelen) AS b FROM packets
GROUP BY time/2, src_asn, dst_asn;
-- name: w_networks
SELECT time/2 AS t, src_net_name, dst_net_name, dst_as_name, count(*) AS n FROM packets
GROUP BY time/2, src_net_name, dst_net_name, dst_as_name;
-- name: w_flow_protocols
SELECT time/60 AS t, protocol, count(*) AS flows, sum(packets) AS pkts, sum(est_bytes) AS bytes
FROM flows GROUP BY time/60, protocol;
-- name: w_flow_pairs
SELECT time/60 AS t, src_ip, dst_ip, src_port, dst_port, protocol, sum(bytes) AS bytes,
       count(*) AS flows
FROM flows WHERE protocol = 6 OR protocol = 17
GROUP BY time/60, src_ip, dst_ip, src_port, dst_port, protocol;
-- name: w_flow_exporters
SELECT time/60 AS t, exporter, input_if, count(DISTINCT dst_ip) AS dsts, sum(bytes) AS bytes
FROM flows GROUP BY time/60, exporter, input_if ORDER BY bytes DESC LIMIT 10;
-- name: w_flow_as
SELECT time/60 AS t, src_asn, dst_asn, dst_net_name, sum(bytes) AS bytes FROM flows
WHERE NOT in_prefix(dst_ip, '10.0.0.0/8') GROUP BY time/60, src_asn, dst_asn, dst_net_name;
-- name: w_flow_sel
SELECT src_ip, dst_ip, bytes FROM flows WHERE protocol = 6 AND src_port = 443;
-- name: w_sample_hosts
SELECT time/1 AS t, agent, src_ip, dst_ip, count(*) AS n, sum(est_bytes) AS bytes FROM samples
GROUP BY time/1, agent, src_ip, dst_ip;
-- name: w_sample_ports
SELECT time/1 AS t, input_if, dst_port, approx_count_distinct(src_ip) AS srcs,
       sum(est_packets) AS pkts
FROM samples WHERE protocol = 6 OR protocol = 17 GROUP BY time/1, input_if, dst_port;
-- name: w_sample_as
SELECT time/2 AS t, src_asn, dst_asn, src_net_role, count(*) AS n FROM samples
GROUP BY time/2, src_asn, dst_asn, src_net_role;
-- name: w_sample_sel
SELECT ts, agent, src_ip, dst_ip, dns_qname FROM samples WHERE dst_port = 53 OR src_port = 53;
-- name: w_counters
SELECT time/10 AS t, agent, if_index, max(in_octets) AS i, max(out_octets) AS o,
       sum(in_errors) AS e
FROM counters GROUP BY time/10, agent, if_index;
-- name: w_counter_sel
SELECT ts, agent, if_index, if_speed, in_discards FROM counters WHERE if_oper_up = 1
