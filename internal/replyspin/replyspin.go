package replyspin

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"runtime"
	"sync/atomic"
	"time"
)

// DefaultMax is the longest a read polls for its reply by default: a few loopback
// or same-rack round trips.
const DefaultMax = 100 * time.Microsecond

// Spinner marks the calls whose reads may poll and dials the connections that
// do. The zero value is not usable; a nil *Spinner marks nothing (Begin and End
// do nothing). Its methods are safe for concurrent use, but the calls it marks
// must not overlap one another (leash's lone lane runs one call at a time).
type Spinner struct {
	max   time.Duration
	epoch time.Time // the origin of the monotonic times below

	depth atomic.Int32  // Begin calls not yet ended (nested calls share one mark)
	seq   atomic.Uint64 // the number of the last call marked
	cur   atomic.Uint64 // the number of the call marked now; 0 when none is
	avg   atomic.Int64  // running average reply time in ns; 0 before the first

	polled, parked atomic.Uint64 // replies read by polling, and reads that parked after polling
	polling        atomic.Int32  // polls under way (for tests)
}

// New returns a Spinner whose reads poll for at most max. It returns nil, whose
// reads never poll, for a max of zero or less, and on a machine with one CPU,
// where the poll would only keep a local server from running (sync.Mutex spins
// on the same condition).
func New(max time.Duration) *Spinner {
	if max <= 0 || runtime.NumCPU() < 2 {
		return nil
	}
	return &Spinner{max: max, epoch: time.Now()}
}

// Begin marks the start of a call alone in flight: reads on a connection written
// from now until the matching End may poll. Begin and End pair up; nested pairs
// belong to the outermost.
func (s *Spinner) Begin() {
	if s == nil {
		return
	}
	if s.depth.Add(1) == 1 {
		s.cur.Store(s.seq.Add(1))
	}
}

// End ends the mark Begin made.
func (s *Spinner) End() {
	if s == nil {
		return
	}
	if s.depth.Add(-1) == 0 {
		s.cur.Store(0)
	}
}

// Counts reports how many replies were read by polling, and how many polls ran
// out of budget and parked.
func (s *Spinner) Counts() (polled, parked uint64) {
	if s == nil {
		return 0, 0
	}
	return s.polled.Load(), s.parked.Load()
}

// ErrTLS is DialContext's error for a TLS configuration: leash dials no TLS
// connection yet, and this dialer does not pretend to.
var ErrTLS = errors.New("leash: replyspin dials plain TCP only; TLS is not supported")

// DialContext dials addr over TCP with d. It has the shape of
// rueidis.ClientOption.DialCtxFn and fails with ErrTLS when tlsCfg is set. The
// connection it returns polls for replies inside marked calls; a nil Spinner's
// is the plain TCP connection.
func (s *Spinner) DialContext(ctx context.Context, addr string, d *net.Dialer, tlsCfg *tls.Config) (net.Conn, error) {
	if tlsCfg != nil {
		return nil, ErrTLS
	}
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil || s == nil {
		return nc, err
	}
	return &conn{Conn: nc, s: s, poller: newPoller(nc)}, nil
}

// now is the time since s.epoch, monotonic.
func (s *Spinner) now() int64 { return int64(time.Since(s.epoch)) }

// budget is how long a read polls now: twice the average reply time, at most
// max; the whole max before any reply was timed; nothing once the average is
// above max.
func (s *Spinner) budget() time.Duration {
	avg := time.Duration(s.avg.Load())
	switch {
	case avg == 0:
		return s.max
	case avg > s.max:
		return 0
	}
	return min(2*avg, s.max)
}

// observe folds one reply's time into the running average (weight 1/8), counted
// as at most 8 times the maximum: one reply from a server that stalled for
// seconds turns polling off for at most about 16 fast replies (fewer the faster
// they are), not for thousands. Marked calls do not overlap, so a plain load and
// store suffice; the rare read of another connection written during a marked
// call (a subscription's, a keep-alive PING's) may lose one sample.
func (s *Spinner) observe(writtenAt int64) {
	d := min(s.now()-writtenAt, int64(8*s.max))
	if d <= 0 {
		d = 1
	}
	avg := s.avg.Load()
	if avg == 0 {
		s.avg.Store(d)
		return
	}
	s.avg.Store(avg + (d-avg)/8)
}

// conn is a connection that polls for the reply to a write made inside a
// marked call.
type conn struct {
	net.Conn
	s      *Spinner
	poller poller // nil where polling is not supported: reads always park

	wroteIn atomic.Uint64 // the marked call during which the last unanswered write was made
	wroteAt atomic.Int64  // when (Spinner.now)
}

// Write writes p and, inside a marked call, notes that a reply is due.
func (c *conn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if seq := c.s.cur.Load(); seq != 0 {
		c.wroteAt.Store(c.s.now())
		c.wroteIn.Store(seq)
	}
	return n, err
}

// Read reads as net.Conn does; the first read after a write made inside the
// call marked now polls first, for up to the Spinner's budget. Any read that
// returns data ends the wait for a reply: a reader that was parked already when
// the write was made (a subscription connection's) does not poll for a reply
// it has read.
func (c *conn) Read(p []byte) (int, error) {
	seq := c.s.cur.Load()
	if seq == 0 || c.wroteIn.Load() != seq || len(p) == 0 {
		n, err := c.Conn.Read(p)
		if n > 0 {
			c.wroteIn.Store(0)
		}
		return n, err
	}
	c.wroteIn.Store(0)
	if budget := c.s.budget(); budget > 0 && c.poller != nil {
		c.s.polling.Add(1)
		n, err, ok := c.poller.poll(p, budget)
		c.s.polling.Add(-1)
		switch {
		case ok && n > 0:
			c.s.polled.Add(1)
			c.s.observe(c.wroteAt.Load())
			return n, err
		case ok:
			return n, err // the end of the stream: no reply to time
		}
		c.s.parked.Add(1)
	}
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.s.observe(c.wroteAt.Load())
	}
	return n, err
}
