// A lightning-dagster harness in Node.js 20: `fetch` only, no npm dependencies.
//
// Its task is the JSON in LD_TASK (also on standard input; over 128 KiB only in the file LD_TASK_FILE
// names); the model is the OpenAI-compatible server at
// OPENAI_BASE_URL with the key OPENAI_API_KEY. It asks one arithmetic question, scores the reply and posts
// the reward as an Agent Lightning event to AGL_EVENT_URL (bearer AGL_KEY). Any exception exits non-zero,
// which the runner records as the attempt's failure.

import { readFileSync } from "node:fs";

const SYSTEM = "Reply with the number only.";
const NUMBER = /-?\d+(?:\.\d+)?/;

async function post(url, key, body) {
  const response = await fetch(url, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${key}` },
    body: JSON.stringify(body),
  });
  if (!response.ok) {
    throw new Error(`POST ${url} -> ${response.status}: ${await response.text()}`);
  }
  return response.json();
}

// A task too large for an environment variable (over 128 KiB) is only in the file LD_TASK_FILE names.
const task = JSON.parse(process.env.LD_TASK ?? readFileSync(process.env.LD_TASK_FILE, "utf8"));
const messages = [
  { role: "system", content: SYSTEM },
  { role: "user", content: task.question },
];
const completion = await post(`${process.env.OPENAI_BASE_URL}/chat/completions`, process.env.OPENAI_API_KEY, {
  model: "policy",
  messages,
  max_tokens: 16,
});
const reply = completion.choices[0].message.content ?? "";
const match = reply.match(NUMBER);
const reward = match !== null && Number(match[0]) === Number(task.answer) ? 1.0 : 0.0;
await post(process.env.AGL_EVENT_URL, process.env.AGL_KEY, { event_type: "reward", data: { value: reward } });
console.log(JSON.stringify({ task_id: task.task_id, messages, reply, reward }));
