package engine

import (
	"time"

	"github.com/leash-go/leash/timer"
)

// A lock's local state lives from its first use until it has been unused for a
// while. An unused lock state is kept, idle, for between idleKeep and twice that,
// and taken up again if the lock is used meanwhile: a lock taken and released
// over and over (each goroutine on its own lock, say) would otherwise cost a new
// state, its names and key slices and three map entries per acquisition, about a
// tenth of an uncontended cycle's CPU here. At most maxIdleLocks states are kept
// idle; past that, an unused state goes at once.
const (
	idleKeep     = time.Second
	maxIdleLocks = 4096
)

// maxRefusedNames bounds machine.refusedNames. A name dropped to make room only
// costs its next first attempt a refused RESTORE (scriptCall.fresh).
const maxRefusedNames = 4096

// lockFor returns the state of the lock name, made if there is none. An idle
// state of the other kind (fair, plain) is replaced: the kind is checked against
// live states only.
//
// A state of the other kind kept only by renewals in flight (renewsOut) is replaced
// too: the new state takes over their count and renewAnswered (onRenewDone finds
// the state by name), since a renewal is guarded by an owner's field, which the
// owner's holds of either kind write.
func (m *machine) lockFor(name string, fair bool) *lockState {
	var renewsOut int
	var renewAnswered time.Time
	if l := m.locks[name]; l != nil {
		if (l.fair != nil) == fair && l.idle {
			l.idle = false
			m.idleLocks--
			return l
		}
		if (l.fair != nil) == fair || !(l.idle || onlyRenewals(l)) {
			return l
		}
		renewsOut, renewAnswered = l.renewsOut, l.renewAnswered
		m.forget(l)
	}
	m.nextID++
	l := &lockState{id: m.nextID, name: name, channel: channelName(name), renewsOut: renewsOut, renewAnswered: renewAnswered}
	if _, ok := m.refusedNames[name]; ok {
		l.refusedLast = true
		delete(m.refusedNames, name)
	}
	regs, order := "leash_lock_reg:"+tagged(name), "leash_lock_regq:"+tagged(name)
	l.nameKeys = []string{l.name, regs, order}
	l.releaseKeys = []string{l.name, l.channel, regs, order}
	if fair {
		k := newFairKeys(name, m.cfg.clientID)
		l.fair = &k
	}
	m.locks[name] = l
	m.lockByID[l.id] = l
	m.lockByChannel[l.channel] = l
	return l
}

// unused reports whether nothing refers to l: no waiter, hold, call or renewal in
// flight or subscription, nor a channel a failed Subscribe left with the registry
// (subLeft).
func unused(l *lockState) bool {
	return l.renewsOut == 0 && unusedButRenewals(l)
}

// unusedButRenewals is unused, renewals in flight aside.
func unusedButRenewals(l *lockState) bool {
	return l.queue.len == 0 && len(l.holders) == 0 && l.attempting == nil && l.inflight == 0 &&
		l.sub == subNone && !l.subLeft && l.cleanupsWaiting == 0
}

// onlyRenewals reports whether nothing but renewals in flight keeps l live.
func onlyRenewals(l *lockState) bool { return l.renewsOut > 0 && unusedButRenewals(l) }

// maybeForget marks a lock's state idle once nothing refers to it (see idleKeep).
func (m *machine) maybeForget(l *lockState) {
	if !unused(l) || l.idle {
		return
	}
	if l.mayBeRegistered && l.fair == nil && !m.closing {
		// A registration of this client's may be left in Redis with nobody here
		// to drop it (a release carries the drop when the last waiter is gone):
		// each release would grant to it and this client give the grant back,
		// until it expired. The state stays until the leave has run.
		m.dropRegistration(l)
		return
	}
	m.disarmRetry(l)
	l.backoff = 0 // as a fresh state's
	l.idle = true
	l.idleSince = m.now
	m.idleLocks++
	if m.idleLocks > maxIdleLocks || m.closing {
		m.forget(l)
		return
	}
	if !l.inIdleQueue {
		l.inIdleQueue = true
		m.idleQueue = append(m.idleQueue, l)
	}
	if !m.forgetArmed {
		m.forgetArmed = true
		m.schedule(timer.Key{Kind: kindForget}, idleKeep)
	}
}

// forget drops a lock's state. A refusal it remembers (refusedLast) is kept by
// name, so a lock held elsewhere and tried now and then (a TryLock every few
// seconds) does not look free to each new state.
func (m *machine) forget(l *lockState) {
	if l.idle {
		m.idleLocks--
	}
	if l.refusedLast && l.fair == nil {
		if m.refusedNames == nil {
			m.refusedNames = make(map[string]struct{})
		}
		if len(m.refusedNames) >= maxRefusedNames {
			for name := range m.refusedNames { // any one
				delete(m.refusedNames, name)
				break
			}
		}
		m.refusedNames[l.name] = struct{}{}
	}
	m.disarmRetry(l)
	delete(m.locks, l.name)
	delete(m.lockByID, l.id)
	delete(m.lockByChannel, l.channel)
}

// onForget drops the states idle for idleKeep or more, and comes back while any
// are left. It looks only at the idle queue: the states marked idle since they
// last left it, each once however often it was used and left idle again. A state
// in use is taken off the queue; maybeForget puts it back when it is idle again.
func (m *machine) onForget(now time.Time) {
	m.forgetArmed = false
	kept := m.idleQueue[:0]
	for _, l := range m.idleQueue {
		switch {
		case m.locks[l.name] != l || !l.idle:
			l.inIdleQueue = false // forgotten, or in use
		case now.Before(l.idleSince.Add(idleKeep)) || !unused(l):
			kept = append(kept, l)
		default:
			l.inIdleQueue = false
			m.forget(l)
		}
	}
	clear(m.idleQueue[len(kept):])
	m.idleQueue = kept
	if len(m.idleQueue) > 0 && !m.closing {
		m.forgetArmed = true
		m.schedule(timer.Key{Kind: kindForget}, idleKeep)
	}
}
