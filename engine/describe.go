package engine

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/leash-go/leash/futures"
)

// describeMsg asks for DescribeLock's line.
type describeMsg struct {
	lock   string
	future *futures.Future[string]
}

func (describeMsg) isMessage() {}

// DescribeLock returns one line that tells what this engine knows of the named
// lock: its subscription, whether a call that decides it is in flight, its chain
// of local handoffs, its holds and its waiters, the head first. It is meant for
// failure reports and debugging; the format may change between versions.
func (e *Engine) DescribeLock(ctx context.Context, name string) (string, error) {
	f := futures.New[string]()
	return ask(e, ctx, describeMsg{lock: name, future: f}, f)
}

func (s subState) String() string {
	switch s {
	case subNone:
		return "none"
	case subSubscribing:
		return "subscribing"
	case subSubscribed:
		return "subscribed"
	case subUnsubscribing:
		return "unsubscribing"
	}
	return fmt.Sprintf("subState(%d)", uint8(s))
}

// describe is DescribeLock's line for name.
func (m *machine) describe(name string, now time.Time) string {
	l := m.locks[name]
	if l == nil {
		return fmt.Sprintf("%s: no state (grant channel %s)", name, m.grantSub)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s: sub %s (resub %t) grant channel %s; attempting %t handingOff %t parked %t wakePending %t",
		name, l.sub, l.resubAfter, m.grantSub, l.attempting != nil, l.handingOff, l.parked, l.wakePending)
	fmt.Fprintf(&b, "; retry armed %t yield %t backingOff %t; registered %t mayBeRegistered %t; chain %d",
		l.retryGen != 0, m.yieldPending(l), l.backingOff, l.registered, l.mayBeRegistered, l.chain)
	if !l.chainStart.IsZero() {
		fmt.Fprintf(&b, " (last started %v ago)", now.Sub(l.chainStart).Round(time.Millisecond))
	}
	fmt.Fprintf(&b, "; inflight %d", l.inflight)
	for _, h := range l.holders {
		fmt.Fprintf(&b, "; hold owner %d count %d field %s expires in %v busy %t",
			h.owner, h.count, h.field, h.expiresAt.Sub(now).Round(time.Millisecond), m.ownerBusy(holdKey{l.id, h.owner}))
	}
	fmt.Fprintf(&b, "; %d waiters", l.queue.len)
	for w := l.queue.head; w != nil; w = w.next {
		fmt.Fprintf(&b, " [w%d owner %d refused %t registered %t attempting %t grantHeard %t busy %t]",
			w.id, w.owner, w.refused, w.registered, w.attempting, w.grantHeard, m.ownerBusy(holdKey{l.id, w.owner}))
	}
	return b.String()
}
