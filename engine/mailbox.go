package engine

import "sync"

// mailbox carries the engine's internal notifications — timer firings, unlock
// messages (those that find the engine busy: see Engine.stepNotice),
// cancellations, subscription results, and the replies of calls that no
// sender steps itself (the unbatched runners of tests) — from any goroutine to the
// loop. post never blocks and never drops: items are appended under a mutex and
// the loop is nudged through a capacity-1 signal channel, so a burst of thousands
// (timer firings in one tick) reaches the loop as one batch.
type mailbox struct {
	mu    sync.Mutex
	items []message
	spare []message // the previous batch's backing array, reused

	// signal has capacity 1: one pending nudge is enough, since the loop drains
	// everything posted before it looks.
	signal chan struct{}
}

func newMailbox() *mailbox { return &mailbox{signal: make(chan struct{}, 1)} }

// post appends msg and nudges the loop. Safe from any goroutine; never blocks.
func (b *mailbox) post(msg message) {
	b.mu.Lock()
	b.items = append(b.items, msg)
	b.mu.Unlock()
	select {
	case b.signal <- struct{}{}:
	default:
	}
}

// empty reports whether nothing waits to be drained. Safe from any goroutine.
func (b *mailbox) empty() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.items) == 0
}

// drain returns everything posted so far. The returned slice is valid until the
// next drain.
func (b *mailbox) drain() []message {
	b.mu.Lock()
	items := b.items
	clear(b.spare) // the previous batch, processed by now: drop its references
	b.items = b.spare[:0]
	b.spare = items
	b.mu.Unlock()
	return items
}
