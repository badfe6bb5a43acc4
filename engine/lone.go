package engine

import (
	"context"
	"time"

	"github.com/leash-go/leash/internal/scripts"
)

// The lone lane: a script call alone in flight goes on the runner's dedicated
// connection, where the call is written and its reply read on the calling
// goroutine (scripts.LoneRunner), as plain commands where the runner has them
// for it (fresh attempts, quiet releases); and a caller whose request finds the
// engine idle steps the machine and runs its own call itself (tryDirect).

// tryDirect serves a caller on its own goroutine when the loop is idle (nobody
// holds mu, no request is queued): it steps the machine with msg and, if that
// step's only effect is one script call, the caller's own (see takeLone), and no
// batch is in flight, runs the call itself on the runner's lone lane and steps the
// machine with the reply (runDirect). The request, the call and the answer then
// cost no goroutine hand-off at all: measured here (BenchmarkMutexUncontended), a
// Lock and Unlock pair took about 115 µs this way against about 185 µs through the
// loop, and about 110 µs for a bare SET NX PX and compare-and-delete. It reports
// false, having done nothing, when the loop is busy, a request is queued, or the
// engine is closed: the caller then sends msg to the inbox as usual (and send
// reports ErrClosed).
//
// A call in flight is never cut short: its caller waits for it. That is no change
// for an acquire attempt, whose caller waits for the attempt in flight even when
// its context ends (onCancel). An Unlock whose context ends while its release is
// at the server waits for that release too (and so returns its answer), where
// through the loop it would have returned ctx's error at once; one whose context
// has ended before it starts does not come here. Acquire's caller is promised a
// channel at once and never comes here.
//
// A direct step may go ahead of mailbox items already posted (timer firings,
// cancellations, unlock messages), as the loop's select between the inbox and the
// mailbox could too; it never goes ahead of a request already queued (queued).
func (e *Engine) tryDirect(ctx context.Context, msg message) bool {
	e.gate.RLock()
	// Holding gate while taking mu: Close cannot have sent closeMsg, so msg is
	// handled before it, as if it had been queued first.
	ok := !e.closed && e.queued.Load() == 0 && e.mu.TryLock()
	e.gate.RUnlock()
	if !ok {
		return false
	}
	if e.queued.Load() != 0 { // the loop took a request off the inbox and waits for mu
		e.mu.Unlock()
		return false
	}
	e.m.handle(msg, time.Now())
	lone, call, run := e.takeLone(msg)
	e.apply()
	e.mu.Unlock()
	if run {
		e.runDirect(ctx, msg, lone, call)
	}
	return true
}

// takeLone takes the step's script call out of the effects for runDirect when it
// is the only call of the step and msg's own (an acquireMsg's attempt, an
// unlockMsg's release), no batch is in flight or pending, and the runner has a
// lone lane. It counts the call as a send in flight, so the lane stays the
// caller's alone (subscription calls and the test fakes' unbatched calls, which
// go out on their own goroutines, do not use it). Called under mu.
func (e *Engine) takeLone(msg message) (scripts.LoneRunner, scriptCall, bool) {
	fx := &e.m.fx
	lone, ok := e.runner.(scripts.LoneRunner)
	if !ok || len(fx.scripts) != 1 || len(e.pending) != 0 || e.sends != 0 {
		return nil, scriptCall{}, false
	}
	call := fx.scripts[0]
	switch msg := msg.(type) {
	case *acquireMsg:
		ok = call.purpose == purposeAttempt && call.waiter == msg.id
	case *unlockMsg:
		ok = call.purpose == purposeUnlock && call.unlock == msg.future
	default:
		ok = false
	}
	if !ok {
		return nil, scriptCall{}, false
	}
	fx.scripts[0] = scriptCall{}
	fx.scripts = fx.scripts[:0]
	e.sends++
	e.callSent(&call)
	return lone, call, true
}

// runDirect runs call, msg's own, on the lone lane on the calling goroutine and
// steps the machine with its reply, as the loop would have. Like every call, it
// runs under context.Background(), bounded by the connection's timeouts and
// Close's AbortIO: a call cut short could still run on the server after the
// clean-ups its failure starts. If ctx (an acquire's) ended meanwhile, the machine
// hears of that first, as it would have through the loop.
func (e *Engine) runDirect(ctx context.Context, msg message, lone scripts.LoneRunner, call scriptCall) {
	done := doLone(lone, call)
	e.mu.Lock()
	now := time.Now()
	e.sends--
	if a, ok := msg.(*acquireMsg); ok && ctx.Err() != nil {
		e.m.handle(cancelMsg{id: a.id, err: ctx.Err()}, now)
	}
	e.step(done, now)
	e.apply()
	if e.drained() {
		e.mail.post(wakeMsg{}) // the loop waits for this call before it returns
	}
	e.mu.Unlock()
}

// doLone is doScript on the runner's lone lane (at most one call at a time). A
// fresh attempt goes as the runner's plain commands for a free lock, when it
// has them (scripts.FreshRunner, scripts.FreshFairRunner); if they do not
// settle it, the script answers, dated at its own send (sentAtOf). A quiet
// release goes as the runner's plain commands for it, when it has them
// (scripts.QuietReleaser).
func doLone(lone scripts.LoneRunner, call scriptCall) scriptDone {
	sentAt := time.Now()
	reply, err := runLone(lone, call)
	return scriptDone{call: call, sentAt: sentAtOf(reply, sentAt), reply: reply, err: err}
}

// runLone sends call on the lone lane, as plain commands where it can (doLone).
func runLone(lone scripts.LoneRunner, call scriptCall) (scripts.Reply, error) {
	ctx := context.Background()
	switch {
	case call.fresh && call.script == scripts.FairAcquire:
		if f, ok := lone.(scripts.FreshFairRunner); ok {
			return f.RunLoneFreshFair(ctx, call.keys, call.args, call.channel)
		}
	case call.fresh:
		if f, ok := lone.(scripts.FreshRunner); ok {
			return f.RunLoneFresh(ctx, call.keys, call.args)
		}
	case call.quiet:
		if q, ok := lone.(scripts.QuietReleaser); ok {
			return q.RunLoneQuietRelease(ctx, call.script, call.keys, call.args)
		}
	}
	return lone.RunLone(ctx, call.script, call.keys, call.args)
}
