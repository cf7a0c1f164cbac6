-- DESIGN's Q1-Q3 (the prefilter paper's motivating example): UDP bandwidth, DNS requests and
-- DNS responses per minute and (source, destination) pair.
-- name: udp_bw
SELECT time/60 AS t, src_ip, dst_ip, sum(wirelen) AS bytes, count(*) AS pkts
FROM packets WHERE protocol = 17 GROUP BY time/60, src_ip, dst_ip;
-- name: dns_req
SELECT time/60 AS t, src_ip, dst_ip, sum(wirelen) AS bytes, count(*) AS pkts
FROM packets WHERE protocol = 17 AND dst_port = 53 AND dns_qr = 0 GROUP BY time/60, src_ip, dst_ip;
-- name: dns_resp
SELECT time/60 AS t, src_ip, dst_ip, sum(wirelen) AS bytes, count(*) AS pkts
FROM packets WHERE protocol = 17 AND src_port = 53 AND dns_qr = 1 GROUP BY time/60, src_ip, dst_ip;
