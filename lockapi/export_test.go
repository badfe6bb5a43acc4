package lockapi

import (
	"context"
	"time"
)

// DescribeLock is the engine's line about the named lock (engine.DescribeLock),
// for the tests' failure reports; an error's text when there is none.
func DescribeLock(c *Client, name string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := c.engine.DescribeLock(ctx, name)
	if err != nil {
		return name + ": " + err.Error()
	}
	return s
}

// ReplySpinCounts is how many replies of c's lone lane were read by polling, and
// how many polls ran out of budget (see package replyspin); zeros when c does not
// poll.
func ReplySpinCounts(c *Client) (polled, parked uint64) { return c.spin.Counts() }
