-- wrk script for warmroute's benchmarks: POST an OpenAI chat/completions JSON body with a
-- session id (in a header, or in the body) rotating over a fixed set of session ids.
--
--   wrk -t1 -c32 -d10s --latency -s bench/wrk/chat.lua http://127.0.0.1:PORT -- PATH MODE [SESSIONS] [ID] [HEADER]
--
-- PATH      request path (e.g. /bench/v1/chat/completions or /v1/chat/completions)
-- MODE      "json" (non-streaming), "stream" ("stream":true and Accept: text/event-stream) or
--           "prompt" (non-streaming, with a realistic prompt: 40 earlier turns of prose and
--           code, about 50 KB of JSON with an escape every ~27 bytes; see prompt_messages)
--           or "stream-prompt" (that prompt, streamed)
-- SESSIONS  number of rotating session ids (default 64)
-- ID        where the session id goes: "header" (the HEADER below, default), "body"
--           (metadata.session_id in the JSON body, no header) or "none" (no id at all)
-- HEADER    the header that carries the id when ID is "header" (default X-Session-ID; e.g.
--           X-SMG-Routing-Key for sglang-router's manual policy)
--
-- The requests are built once per thread in init(); request() only rotates through them.
-- done() prints one machine-readable line, prefixed "WRKJSON ", with counts and latency
-- percentiles in microseconds.

local reqs = {}
local nreqs = 0
local idx = 0

-- The "messages" of a long conversation about code, as a coding assistant sends them: 40
-- turns of about 1.3 KB each, prose and a code block, so the JSON holds an escape (\n, \")
-- every ~27 bytes. Session `i` changes the text a little so no two bodies are the same.
local function prompt_messages(i)
  local turns = {}
  for t = 1, 40 do
    local role = (t % 2 == 1) and "user" or "assistant"
    local block = string.format(
      "Turn %d of session %d: the handler below reads the id before the body.\\n```rust\\n" ..
      "fn handle(req: &Request) -> Result<Response> {\\n    let id = req.header(\\\"x-session-id\\\");\\n" ..
      "    let body = req.body()?;\\n    route(id, body)\\n}\\n```\\nIt falls back to the body " ..
      "when the header is missing, and logs \\\"no id\\\" otherwise. ", t, i)
    turns[#turns + 1] = string.format('{"role":"%s","content":"%s"}', role, string.rep(block, 4))
  end
  return "[" .. table.concat(turns, ",") .. "]"
end

function init(args)
  local path = args[1] or "/v1/chat/completions"
  local stream = (args[2] == "stream" or args[2] == "stream-prompt")
  local prompt = (args[2] == "prompt" or args[2] == "stream-prompt")
  local sessions = tonumber(args[3] or "64")
  local where = args[4] or "header"
  local header = args[5] or "X-Session-ID"
  -- wrk.format() does not add Host or Content-Type for us when it is given a header table.
  local host = wrk.host
  if wrk.port then
    host = host .. ":" .. tostring(wrk.port)
  end
  for i = 1, sessions do
    local sid = string.format("bench-session-%03d", i)
    local meta = ""
    if where == "body" then
      meta = string.format(',"metadata":{"session_id":"%s"}', sid)
    end
    local messages = string.format(
      '[{"role":"user","content":"bench session %d: reply with eight tokens"}]', i)
    if prompt then
      messages = prompt_messages(i)
    end
    local body = string.format('{"model":"m","messages":%s,"max_tokens":8%s%s}',
      messages, stream and ',"stream":true' or "", meta)
    local headers = {
      ["Host"] = host,
      ["Content-Type"] = "application/json",
      ["Accept"] = stream and "text/event-stream" or "application/json",
    }
    if where == "header" then
      headers[header] = sid
    end
    reqs[i] = wrk.format("POST", path, headers, body)
  end
  nreqs = sessions
end

-- WRK_DELAY_MS set: every connection waits that long after each response before its next
-- request (wrk's delay() hook), so the offered load is about connections / (delay + latency)
-- whatever the proxy could take: latency at equal load. Unset: no delay() at all, as wrk's
-- own closed loop.
local think_ms = tonumber(os.getenv("WRK_DELAY_MS") or "")
if think_ms then
  function delay()
    return think_ms
  end
end

function request()
  idx = idx % nreqs + 1
  return reqs[idx]
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"mean":%.1f,"stdev":%.1f,"min":%d,"p50":%d,"p90":%d,"p99":%d,"p999":%d,"max":%d}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.mean, latency.stdev, latency.min,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max))
end
