package engine

import (
	"time"

	"github.com/leash-go/leash/timer"
)

// A lock's subscription: its unlock channel (or, for a fair lock, the pattern of
// this client's per-waiter channels) is subscribed while it has local waiters, and
// kept for cfg.linger after the last one leaves.

// subscribeRetry is how soon a lock whose subscription was not confirmed retries.
const subscribeRetry = 100 * time.Millisecond

func (m *machine) subscribe(l *lockState) {
	switch l.sub {
	case subNone:
		l.sub = subSubscribing
		m.stats.Subscribes++
		m.fx.subs = append(m.fx.subs, m.subOp(l, false))
	case subSubscribed:
		if l.lingerGen != 0 {
			m.cancelTimer(timer.Key{Kind: kindLinger, ID: l.id, Gen: l.lingerGen})
			l.lingerGen = 0
		}
	case subUnsubscribing:
		l.resubAfter = true
	}
}

func (m *machine) onSubscribed(msg subscribeDone, now time.Time) {
	if msg.lock == 0 {
		m.onGrantsSubscribed(msg.err, now)
		return
	}
	l := m.lockByID[msg.lock]
	if l == nil {
		return
	}
	if msg.err != nil && !m.closing {
		// Not confirmed (a timeout, no connection): whether messages will come is
		// unknown, and a release that finds nobody listening publishes nothing.
		// The head retries soon, and subscribes again if refused. With no waiter
		// left, what the registry kept goes (lingerOrUnsubscribe): counted as
		// subscribed, the lock would let a waiter that comes during its linger
		// wait for messages that may never come.
		l.sub = subNone
		l.subLeft = true
		if l.queue.len == 0 {
			m.lingerOrUnsubscribe(l)
			return
		}
		l.parked = false
		m.armRetry(l, subscribeRetry)
		return
	}
	l.sub = subSubscribed
	l.subLeft = false
	if l.queue.len == 0 {
		m.lingerOrUnsubscribe(l)
		return
	}
	// A release between the refused attempt and the subscription went unheard:
	// retry once now that messages will arrive.
	switch {
	case l.fair != nil:
		m.fairWakeFirst(l, now)
	default:
		m.wakeHead(l, now)
	}
}

// lingerOrUnsubscribe keeps an idle lock's subscription for cfg.linger, so a lock
// that is busy on and off does not pay a subscribe and an unsubscribe each time.
// What a failed Subscribe left with the registry (lockState.subLeft) goes at once.
func (m *machine) lingerOrUnsubscribe(l *lockState) {
	if l.sub == subNone && l.subLeft && l.queue.len == 0 {
		m.unsubscribe(l) // what a failed Subscribe left registered
		return
	}
	if l.sub != subSubscribed || l.queue.len > 0 {
		return
	}
	if m.closing || m.cfg.linger <= 0 || l.registered {
		// A client that registered for direct grants leaves at once: lingering,
		// it would count as a listener that did not register, and the other
		// clients' releases would publish rather than grant (lock_lib.lua).
		m.unsubscribe(l)
		return
	}
	if l.lingerGen == 0 {
		m.nextID++
		l.lingerGen = m.nextID
		m.schedule(timer.Key{Kind: kindLinger, ID: l.id, Gen: l.lingerGen}, m.cfg.linger)
	}
}

func (m *machine) unsubscribe(l *lockState) {
	l.sub = subUnsubscribing
	l.subLeft = false
	l.registered = false
	l.lingerGen = 0
	m.fx.subs = append(m.fx.subs, m.subOp(l, true))
}

// subOp names what a lock listens on: its unlock channel, or for a fair lock the
// pattern of this client's per-waiter channels.
func (m *machine) subOp(l *lockState, unsubscribe bool) subOp {
	if l.fair != nil {
		return subOp{lock: l.id, channel: l.fair.pattern, pattern: true, unsubscribe: unsubscribe}
	}
	return subOp{lock: l.id, channel: l.channel, unsubscribe: unsubscribe}
}

func (m *machine) onUnsubscribed(msg unsubscribeDone, now time.Time) {
	if msg.lock == 0 { // the grant channel (unsubscribeGrants)
		m.grantSub = subNone
		return
	}
	l := m.lockByID[msg.lock]
	if l == nil {
		return
	}
	l.sub = subNone
	if (l.resubAfter || l.queue.len > 0) && !m.closing {
		l.resubAfter = false
		m.subscribe(l)
		return
	}
	m.maybeForget(l)
}
