// End-to-end checks of the dashboard in headless Chromium against a real `coli web`.
//
//   COLI_URL=http://127.0.0.1:8000 [COLI_KEY_URL=... COLI_KEY=...] [OUT=test-output/web] \
//   [CHROMIUM=/usr/bin/chromium] node e2e/e2e.mjs
//
// Prints one line per check and exits non-zero on the first failure. Screenshots of each
// page go to $OUT. tests/test_web_e2e.py starts the servers and runs this.
import { chromium } from 'playwright-core'
import { mkdirSync, readFileSync } from 'node:fs'
import { join } from 'node:path'

const URL = process.env.COLI_URL
const KEY_URL = process.env.COLI_KEY_URL
const KEY = process.env.COLI_KEY
const OUT = process.env.OUT || 'test-output/web'
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium'
if (!URL) throw new Error('set COLI_URL')
mkdirSync(OUT, { recursive: true })

const problems = [] // console errors and page errors, from every page
let failed = false

function check(cond, what) {
  if (!cond) {
    console.log(`FAIL ${what}`)
    failed = true
    throw new Error(what)
  }
  console.log(`ok   ${what}`)
}

function watch(page, name) {
  page.on('console', (m) => {
    if (m.type() === 'error') problems.push(`${name}: console: ${m.text()}`)
  })
  page.on('pageerror', (e) => problems.push(`${name}: page error: ${e.message}`))
}

async function shot(page, file) {
  await page.screenshot({ path: join(OUT, file), fullPage: false })
}

const sessions = new WeakMap() // one DevTools session per page: conditions set by one are undone by it
async function throttle(page, bytesPerSecond) {
  let cdp = sessions.get(page)
  if (!cdp) {
    cdp = await page.context().newCDPSession(page)
    await cdp.send('Network.enable')
    sessions.set(page, cdp)
  }
  await cdp.send('Network.emulateNetworkConditions', {
    offline: false,
    latency: 0,
    downloadThroughput: bytesPerSecond > 0 ? bytesPerSecond : -1,
    uploadThroughput: -1,
  })
}

const browser = await chromium.launch({
  executablePath: CHROMIUM,
  headless: true,
  args: [
    '--no-sandbox',
    '--disable-gpu',
    '--disable-background-networking',
    '--disable-component-update',
    '--disable-sync',
    '--no-first-run',
    '--disable-dev-shm-usage',
  ],
})

try {
  const experts = await (await fetch(`${URL}/experts`)).json()

  // ---------------------------------------------------------------- desktop, light theme
  const ctx = await browser.newContext({ viewport: { width: 1280, height: 820 }, colorScheme: 'light' })
  const page = await ctx.newPage()
  watch(page, 'desktop')
  await page.goto(URL + '/')
  await page.getByTestId('model').filter({ hasNotText: '…' }).waitFor()
  check((await page.getByTestId('model').textContent()) !== '…', 'the page loads and names the model')
  check((await page.evaluate(() => document.documentElement.dataset.theme)) === 'light', 'light theme by default (prefers light)')

  // Chat: a streamed reply. The network is throttled so that the stream arrives in pieces
  // a person could watch; an observer in the page records every length the answer had.
  await throttle(page, 3000)
  await page.evaluate(() => {
    window.__lengths = []
    const t = document.querySelector('[data-testid=transcript]')
    new MutationObserver(() => {
      const msgs = t.querySelectorAll('[data-testid=msg-assistant] > .text')
      const last = msgs[msgs.length - 1]
      if (last) window.__lengths.push(last.textContent.length)
    }).observe(t, { subtree: true, childList: true, characterData: true })
  })
  await page.getByTestId('chat-input').fill('Hello')
  await page.getByTestId('chat-input').press('Enter')
  await page.getByTestId('stop').waitFor()
  await page.getByTestId('send').waitFor({ timeout: 60000 })
  const reply = (await page.getByTestId('msg-assistant').last().locator('> .text').textContent()).trim()
  const lengths = await page.evaluate(() => [...new Set(window.__lengths.filter((n) => n > 0))])
  check(reply.length > 0, `the streamed reply appears: ${JSON.stringify(reply.slice(0, 60))}`)
  check(lengths.length >= 3, `it arrived in pieces (${lengths.length} distinct lengths)`)
  const ttft = await page.getByTestId('ttft').textContent()
  check(/\d+ ms/.test(ttft), `TTFT shown (${ttft})`)
  check(/\d+ ms/.test(await page.getByTestId('queue').textContent()), 'queue wait shown (x-colibri-queue-wait-ms)')
  check(/\d/.test(await page.getByTestId('tps').textContent()), 'tok/s shown')
  await page.getByTestId('tierbar').waitFor()
  check(/RAM .*B/.test(await page.getByTestId('tierbar').textContent()), 'the tier bar shows RAM and disk bytes')

  // Stop: the Stop button ends the answer while it streams; the composer is usable again.
  await throttle(page, 400)  // slow enough that a ~45-token answer is still streaming when Stop is clicked
  await page.getByTestId('chat-input').fill("What does 'water' mean?")  // the built-in model's longest answer (~45 tokens)
  await page.getByTestId('send').click()
  await page.getByTestId('stop').waitFor()
  await page.waitForFunction(() => {
    const msgs = document.querySelectorAll('[data-testid=msg-assistant] > .text')
    return msgs[msgs.length - 1]?.textContent.length > 0
  }, null, { timeout: 60000 })
  await page.getByTestId('stop').click()
  await page.getByTestId('send').waitFor({ timeout: 5000 })
  const stopped = await page.getByTestId('msg-assistant').last().locator('> .text').textContent()
  check(stopped.trim().endsWith('…'), `Stop ends the streaming answer (${JSON.stringify(stopped.slice(0, 40))})`)
  check((await page.getByTestId('chat-error').count()) === 0, 'stopping is not an error')
  await throttle(page, 0)

  // KV slot: answer in slot 0 (cache_slot), then export the conversation.
  await page.getByTestId('slot').selectOption('0')
  await page.getByTestId('chat-input').fill('What does cat mean?')
  await page.getByTestId('send').click()
  await page.getByTestId('send').waitFor({ timeout: 60000 })
  const slotReply = (await page.getByTestId('msg-assistant').last().locator('> .text').textContent()).trim()
  check(slotReply.length > 0 && (await page.getByTestId('chat-error').count()) === 0, 'an answer in KV slot 0')
  const [md] = await Promise.all([page.waitForEvent('download'), page.getByRole('button', { name: 'Export .md' }).click()])
  const mdText = readFileSync(await md.path(), 'utf8')
  check(md.suggestedFilename() === 'conversation.md' && mdText.includes('## You\n\nWhat does cat mean?') && mdText.includes(slotReply.slice(0, 20)),
    'export as Markdown')
  const [js] = await Promise.all([page.waitForEvent('download'), page.getByRole('button', { name: 'Export .json' }).click()])
  const exported = JSON.parse(readFileSync(await js.path(), 'utf8'))
  check(exported.messages.length === 6 && exported.messages[4].content === 'What does cat mean?', 'export as JSON')
  await page.getByTestId('slot').selectOption('any')
  await shot(page, 'chat.png')

  // Brio: probabilities of the allowed answers sum to 1, entropy in 0..1.
  await page.getByTestId('dock-brio').click()
  await page.getByTestId('brio-run').click()
  await page.getByTestId('brio-result').waitFor({ timeout: 60000 })
  const ps = await page.getByTestId('brio-choice').evaluateAll((els) => els.map((e) => Number(e.dataset.p)))
  const sum = ps.reduce((a, b) => a + b, 0)
  check(ps.length === 3 && Math.abs(sum - 1) < 1e-6, `Brio: ${ps.length} answers, probabilities sum to ${sum.toFixed(6)}`)
  const entropy = Number(await page.getByTestId('brio-entropy').textContent())
  const verdict = await page.getByTestId('brio-result').getAttribute('data-verdict')
  check(entropy >= 0 && entropy <= 1 && verdict, `Brio: entropy ${entropy} reads as "${verdict}"`)
  await shot(page, 'brio.png')

  // Typed decisions on the same page: one answer per question, each with its bars; choice
  // and score show a confidence in 0..1 (POST /v1/systemone).
  await page.getByTestId('decisions-run').click()
  await page.getByTestId('decision-answer').first().waitFor({ timeout: 60000 })
  const types = await page.getByTestId('decision-answer').evaluateAll((els) => els.map((e) => e.dataset.type))
  check(types.join(',') === 'noul,choice,score', `Decisions: answers of types ${types.join(',')}`)
  const confs = await page.getByTestId('decision-confidence').evaluateAll((els) => els.map((e) => Number(e.textContent)))
  check(confs.length === 2 && confs.every((c) => c >= 0 && c <= 1), `Decisions: confidences ${confs.join(', ')}`)
  await page.getByTestId('decisions').screenshot({ path: join(OUT, 'decisions.png') })

  // Brain: one cell per expert; after a message, the routed experts are lit.
  await page.getByTestId('dock-chat').click()
  await page.getByTestId('chat-input').fill('What does ocean mean?')
  await page.getByTestId('send').click()
  await page.getByTestId('send').waitFor({ timeout: 60000 })
  await page.getByTestId('dock-brain').click()
  await page.getByTestId('expert-grid').waitFor()
  const cells = await page.getByTestId('expert-cell').count()
  check(cells === experts.rows * experts.cols, `Brain: ${cells} cells = ${experts.rows} layers x ${experts.cols} experts`)
  await page.waitForFunction(() => document.querySelectorAll('[data-testid=expert-cell][data-routed="1"]').length > 0, null, {
    timeout: 10000,
  })
  const lit = await page.locator('[data-testid=expert-cell][data-routed="1"]').count()
  check(lit > 0 && lit <= cells, `Brain: ${lit} routed experts lit after a message`)
  await page.getByTestId('expert-cell').nth(experts.cols + 1).hover()
  const info = await page.getByTestId('cell-info').textContent()
  check(/layer 1 · expert 1/.test(info) && /tier/.test(info), `hovering a cell tells layer, index, tier, counts: ${info.slice(0, 70)}`)
  await shot(page, 'brain-live.png')
  await page.getByTestId('tab-explore').click()
  await page.getByTestId('atlas').waitFor({ timeout: 10000 })
  const n = Number(await page.getByTestId('atlas-canvas').getAttribute('data-n'))
  check(n === experts.cols, `Explore: a ${n}x${n} co-activation map`)
  await page.getByTestId('cortex').waitFor({ timeout: 10000 }) // the expert atlas above it is in place
  await page.getByTestId('atlas-canvas').scrollIntoViewIfNeeded()
  const box = await page.getByTestId('atlas-canvas').boundingBox()
  const cellPx = (box.width - 22) / n
  await page.mouse.move(box.x + 22 + cellPx * 1.5, box.y + 22 + cellPx * 0.5) // row 0, column 1
  const pair = await page.locator('.explore .cell-info').textContent()
  check(/expert 0 & expert 1/.test(pair) && /together in \d+ step/.test(pair), `hovering the map tells a pair: ${pair.slice(0, 60)}`)
  await page.getByTestId('prompt-row').first().waitFor({ timeout: 10000 })
  const prompts = await page.getByTestId('prompt-row').count()
  check(prompts >= 1, `Explore: the experts of ${prompts} recent prompt(s)`)
  await shot(page, 'brain-explore.png')

  // Explore: the expert atlas (the built-in model ships one): a map of regions, enter one,
  // an expert's tokens and contexts, search by word, the address survives a reload.
  const atlasDoc = await (await fetch(`${URL}/experts/atlas`)).json()
  await page.getByTestId('cortex').waitFor({ timeout: 10000 })
  const blobs = await page.getByTestId('region-blob').count()
  check(blobs === atlasDoc.regions.length && blobs > 1, `Explore: the atlas map draws ${blobs} regions`)
  await page.evaluate(() => document.querySelectorAll('main, .content').forEach((e) => (e.scrollTop = 0)))
  await shot(page, 'brain-atlas.png')
  const region = atlasDoc.regions[0]
  await page.locator(`[data-testid=region-blob][data-region="${region.id}"]`).click()
  await page.getByTestId('region-view').waitFor()
  check((await page.evaluate(() => location.hash)) === `#brain/explore/${region.id}`, `entering a region sets the address (#brain/explore/${region.id})`)
  const chips = await page.getByTestId('region-expert').count()
  check(chips === region.experts.length, `the region lists its ${chips} experts`)
  await page.getByTestId('region-expert').first().click()
  await page.getByTestId('expert-detail').waitFor()
  const detail = await page.getByTestId('expert-detail').textContent()
  const [l0, e0] = region.experts[0]
  check(detail.includes(`layer ${l0} · expert ${e0}`) && /Top tokens/.test(detail), `an expert's tokens: ${detail.slice(0, 60)}`)
  check((await page.getByTestId('examples').locator('mark').count()) > 0, 'and example contexts, its token marked')
  await shot(page, 'brain-region.png')
  await page.reload()
  await page.getByTestId('region-view').waitFor({ timeout: 15000 })
  check((await page.getByTestId('region-name').textContent()) === region.name && (await page.getByTestId('expert-detail').count()) === 1,
    'a reload shows the same region and expert')
  // search: a word one of the experts fires for
  const word = atlasDoc.layers.flatMap((L) => L.experts.flatMap((e) => e.top_tokens.map((t) => t.token.trim()))).find((w) => /^[a-z]{3,}$/i.test(w))
  await page.getByTestId('atlas-search').fill(word)
  await page.getByTestId('search-hit').first().waitFor()
  const hit = await page.getByTestId('search-hit').first().textContent()
  check(/layer \d+ · expert \d+/.test(hit), `search: "${word}" fires ${hit}`)
  await page.getByTestId('search-hit').first().click()
  await page.getByTestId('expert-detail').filter({ hasText: hit }).waitFor()
  check(true, 'a hit opens that expert')
  await page.getByTestId('show-live').click()
  await page.locator('[data-testid=expert-cell].selected').waitFor({ timeout: 10000 })
  const [, hl, he] = /layer (\d+) · expert (\d+)/.exec(hit)
  const sel = Number(await page.locator('[data-testid=expert-cell].selected').getAttribute('data-i'))
  check(sel === Number(hl) * experts.cols + Number(he) && (await page.evaluate(() => location.hash)) === `#brain/live/L${hl}E${he}`,
    'and "See it in Live routing" marks its cell in the grid')

  // Profiling: the turn's bars by phase, and the trend.
  await page.getByTestId('dock-profiling').click()
  await page.getByTestId('last-turn').waitFor({ timeout: 10000 })
  const bars = await page.getByTestId('last-turn').getByTestId('phase-bar').count()
  check(bars > 0, `Profiling: the last turn has ${bars} phase bars`)
  // the turns that finished: "Hello" and the last message (a stopped answer may end before it is recorded)
  await page.waitForFunction(() => document.querySelectorAll('[data-testid=trend-row]').length >= 2, null, { timeout: 10000 })
  const trend = await page.getByTestId('trend-row').count()
  check(trend >= 2, `Profiling: ${trend} turns in the trend`)
  const acceptance = await page.getByTestId('acceptance').textContent()
  check(/^(—|\d+\.\d%)$/.test(acceptance ?? ''), `Profiling: speculation's acceptance (${acceptance})`)
  await shot(page, 'profiling.png')

  // Theme: switch to dark and back; it sticks across a reload.
  await page.getByTestId('theme').click()
  check((await page.evaluate(() => document.documentElement.dataset.theme)) === 'dark', 'theme switches to dark')
  const bg = await page.evaluate(() => getComputedStyle(document.body).backgroundColor)
  check(bg === 'rgb(15, 18, 22)', `dark background (${bg})`)
  await shot(page, 'profiling-dark.png')
  await page.getByTestId('dock-brain').click()
  await page.getByTestId('tab-live').click()
  await shot(page, 'brain-live-dark.png')
  await page.getByTestId('dock-chat').click()
  await shot(page, 'chat-dark.png')
  await page.reload()
  await page.getByTestId('model').filter({ hasNotText: '…' }).waitFor()
  check((await page.evaluate(() => document.documentElement.dataset.theme)) === 'dark', 'the theme is remembered')
  await page.getByTestId('theme').click()
  check((await page.evaluate(() => document.documentElement.dataset.theme)) === 'light', 'and switches back to light')

  // Keyboard: the dock is reachable with Tab and works with Enter.
  await page.keyboard.press('Tab')
  let reached = false
  for (let i = 0; i < 12 && !reached; i++) {
    reached = await page.evaluate(() => document.activeElement?.dataset?.testid === 'dock-brio')
    if (!reached) await page.keyboard.press('Tab')
  }
  check(reached, 'Tab reaches the dock')
  await page.keyboard.press('Enter')
  check(await page.getByTestId('brio-run').isVisible(), 'Enter on a dock button opens its page')
  await ctx.close()

  // ---------------------------------------------------------------- phone width
  const phone = await browser.newContext({ viewport: { width: 390, height: 844 }, deviceScaleFactor: 2, isMobile: true, hasTouch: true })
  const p2 = await phone.newPage()
  watch(p2, 'phone')
  await p2.goto(URL + '/')
  await p2.getByTestId('model').filter({ hasNotText: '…' }).waitFor()
  const layout = await p2.evaluate(() => {
    const dock = document.querySelector('.dock').getBoundingClientRect()
    return { dockTop: dock.top, dockWidth: dock.width, scrollWidth: document.documentElement.scrollWidth }
  })
  check(layout.dockTop > 600 && layout.dockWidth >= 380, `phone: the dock sits at the bottom, full width (${JSON.stringify(layout)})`)
  check(layout.scrollWidth <= 390, 'phone: nothing overflows sideways on Chat')
  await p2.getByTestId('chat-input').fill('Hello')
  await p2.getByTestId('send').click()
  await p2.getByTestId('send').waitFor({ timeout: 60000 })
  await shot(p2, 'phone-chat.png')
  for (const name of ['brio', 'brain', 'profiling']) {
    await p2.getByTestId(`dock-${name}`).click()
    await p2.waitForTimeout(300)
    const w = await p2.evaluate(() => document.documentElement.scrollWidth)
    check(w <= 390, `phone: nothing overflows sideways on ${name} (${w}px)`)
  }
  await p2.getByTestId('dock-brain').click()
  await shot(p2, 'phone-brain.png')
  await phone.close()

  // ---------------------------------------------------------------- with an API key
  if (KEY_URL) {
    const kctx = await browser.newContext({ viewport: { width: 1024, height: 700 } })
    const kp = await kctx.newPage()
    // the 401s the page provokes before it has the key are expected, not errors
    kp.on('pageerror', (e) => problems.push(`key: page error: ${e.message}`))
    await kp.goto(KEY_URL + '/')
    await kp.getByTestId('settings').waitFor({ timeout: 10000 })
    check(/API key/.test(await kp.getByTestId('settings').textContent()), 'with an API key configured, the dashboard asks for it')
    await shot(kp, 'api-key.png')
    await kp.getByTestId('api-key').fill(KEY)
    await kp.getByTestId('settings-save').click()
    await kp.getByTestId('model').filter({ hasNotText: '…' }).waitFor({ timeout: 10000 })
    await kp.getByTestId('chat-input').fill('Hello')
    await kp.getByTestId('send').click()
    await kp.getByTestId('send').waitFor({ timeout: 60000 })
    const r = (await kp.getByTestId('msg-assistant').last().locator('> .text').textContent()).trim()
    check(r.length > 0 && (await kp.getByTestId('chat-error').count()) === 0, 'and sends it: the chat answers')
    // this server's model has no expert atlas: Explore says how to make one
    await kp.getByTestId('dock-brain').click()
    await kp.getByTestId('tab-explore').click()
    await kp.getByTestId('atlas-none').waitFor({ timeout: 10000 })
    check(/coli atlas --model/.test(await kp.getByTestId('atlas-none').textContent()), 'Explore without an atlas says how to make one')
    await kctx.close()
  }

  // ---------------------------------------------------------------- a server that went away
  {
    const gone = await browser.newContext({ viewport: { width: 1024, height: 700 } })
    const gp = await gone.newPage() // not watched: the refused requests are logged as errors, as they should be
    await gp.goto(URL + '/')
    await gp.getByTestId('model').filter({ hasNotText: '…' }).waitFor()
    await gp.route(/\/(health|experts|profile|v1\/models)$/, (r) => r.abort('connectionrefused'))
    await gp.getByTestId('offline').waitFor({ timeout: 15000 })
    check(true, 'when the server stops answering, the page says so')
    await gp.unroute(/\/(health|experts|profile|v1\/models)$/)
    await gp.getByTestId('offline').waitFor({ state: 'detached', timeout: 15000 })
    check(true, 'and clears it when the server is back')
    await gone.close()
  }

  // ---------------------------------------------------------------- another OpenAI-compatible server
  if (process.env.OTHER_URL) {
    const octx = await browser.newContext({ viewport: { width: 1024, height: 700 } })
    const op = await octx.newPage()
    watch(op, 'other')
    await op.goto(URL + '/')
    await op.getByTestId('model').filter({ hasNotText: '…' }).waitFor()
    await op.getByTestId('settings-open').click()
    await op.getByTestId('settings').getByPlaceholder('https://api.example.com').fill(process.env.OTHER_URL)
    await op.getByTestId('settings-save').click()
    await op.getByTestId('model').filter({ hasText: 'other-model' }).waitFor({ timeout: 10000 })
    await op.getByTestId('chat-input').fill('Hello')
    await op.getByTestId('send').click()
    await op.getByTestId('send').waitFor({ timeout: 30000 })
    const r = (await op.getByTestId('msg-assistant').last().locator('> .text').textContent()).trim()
    check(r === 'Hi from another server.' && (await op.getByTestId('chat-error').count()) === 0,
      `Chat works against another OpenAI-compatible server: ${JSON.stringify(r)}`)
    const reasoning = op.getByTestId('reasoning-block').last()
    check((await reasoning.textContent()).includes('Let me think.'), 'its streamed reasoning is shown apart from the answer')
    check((await reasoning.getAttribute('open')) === null, 'and folded once the answer is done')
    await reasoning.locator('summary').click()
    check((await reasoning.getAttribute('open')) !== null, 'and unfolds on a click')
    await op.getByTestId('dock-brain').click()
    check(/needs a colibri server/.test(await op.locator('.brain').textContent()), 'and the colibri-only pages say what they need')
    await octx.close()
  }

  check(problems.length === 0, `no console errors${problems.length ? ': ' + problems.join(' | ') : ''}`)
} catch (e) {
  if (!failed) console.log(`FAIL ${e.stack || e}`)
  failed = true
} finally {
  await browser.close()
}
process.exit(failed ? 1 : 0)
