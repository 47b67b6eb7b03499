-- wrk script for `python -m loadtest.wrk`: POST /v1/retrieve, one query of the list per request
-- in turn, the route named by the first script argument (single|diffusion|ar; mix: none, the
-- service's A/B split decides); counts every status and prints one JSON line at the end.
-- The second argument: "honor" waits out a 429's Retry-After before the thread's next request,
-- as a well-behaved client does (run one connection per thread: -t C -c C), "ignore" does not.
-- Usage: wrk -t64 -c64 -d20s -s loadtest/wrk.lua http://127.0.0.1:8765 -- diffusion honor q1 ...

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  local route = args[1]
  honor = args[2] == "honor"
  pause_ms = 0
  bodies = {}
  for i = 3, #args do
    local field = (route ~= "mix") and (', "route": "' .. route .. '"') or ""
    bodies[#bodies + 1] = '{"query": "' .. args[i] .. '", "k": 10' .. field .. '}'
  end
  turn = 0
  statuses = {}
end

function request()
  turn = turn % #bodies + 1
  return wrk.format("POST", "/v1/retrieve", {["Content-Type"] = "application/json"},
                    bodies[turn])
end

function delay()
  local ms = pause_ms
  pause_ms = 0
  return ms
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
  if honor and status == 429 then
    pause_ms = 1000 * (tonumber(headers["retry-after"] or headers["Retry-After"] or "1") or 1)
  end
end

function done(summary, latency, requests)
  local counts = {}
  for _, thread in ipairs(threads) do
    local seen = thread:get("statuses")
    for status, n in pairs(seen) do
      counts[status] = (counts[status] or 0) + n
    end
  end
  local parts = {}
  for status, n in pairs(counts) do
    parts[#parts + 1] = string.format('"%d": %d', status, n)
  end
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "errors": {"connect": %d, "read": %d, "write": %d, ' ..
    '"timeout": %d}, "statuses": {%s}, "latency_ms": {"50": %.3f, "90": %.3f, "99": %.3f, ' ..
    '"max": %.3f, "mean": %.3f}}\n',
    summary.requests, summary.duration, summary.errors.connect, summary.errors.read,
    summary.errors.write, summary.errors.timeout, table.concat(parts, ", "),
    latency:percentile(50) / 1000, latency:percentile(90) / 1000,
    latency:percentile(99) / 1000, latency.max / 1000, latency.mean / 1000))
end
