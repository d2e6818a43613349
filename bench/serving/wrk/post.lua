-- POST one fixed body read from a file; at the end write a JSON summary for the harness.
-- Environment: BODY_FILE (the request body), CONTENT_TYPE, HEADER_LENGTH (optional: sets the KServe binary
-- extension's Inference-Header-Content-Length), RESULT_FILE (where done() writes the summary).
local f = assert(io.open(os.getenv("BODY_FILE"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = os.getenv("CONTENT_TYPE") or "application/json"
local header_length = os.getenv("HEADER_LENGTH")
if header_length and header_length ~= "" then
  wrk.headers["Inference-Header-Content-Length"] = header_length
end

function done(summary, latency, requests)
  local out = assert(io.open(os.getenv("RESULT_FILE"), "w"))
  local e = summary.errors
  out:write(string.format(
    '{"requests": %d, "duration_us": %d, "bytes": %d, "errors_connect": %d, "errors_read": %d, ' ..
    '"errors_write": %d, "errors_status": %d, "errors_timeout": %d, "latency_mean_us": %.1f, ' ..
    '"p50_us": %d, "p90_us": %d, "p99_us": %d, "max_us": %d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean, latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
  out:close()
end
